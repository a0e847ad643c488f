"""`ember.engine.context_parallel.shard_micro_batch`'s attention mask: none where attention is
plain causal (sdpa's `is_causal`), unless `always_mask` (a compiled layer sees one kind of mask)."""

import torch

from ember.engine.batching import PreparedDatum, build_micro_batch
from ember.engine.context_parallel import shard_micro_batch


def _micro_batch(*lengths: int):
    items = [PreparedDatum(i, torch.arange(1, n + 1), {"target_tokens": torch.arange(n)}) for i, n in enumerate(lengths)]
    return build_micro_batch(items, packed=True)


def test_one_datum_whose_length_cp_divides_gets_no_mask_unless_always():
    mb = _micro_batch(8)
    assert shard_micro_batch(mb, cp=2, rank=0).mask is None
    mask = shard_micro_batch(mb, cp=2, rank=1, always_mask=True).mask
    assert mask.shape == (1, 1, 8, 8) and mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], torch.ones(8, 8, dtype=torch.bool).tril())


def test_padding_columns_and_packed_segments_are_masked_either_way():
    for mb in (_micro_batch(7), _micro_batch(8, 5)):
        plain, always = (shard_micro_batch(mb, cp=2, rank=0, always_mask=a).mask for a in (False, True))
        assert plain is not None and torch.equal(plain, always)
    seam = shard_micro_batch(_micro_batch(7), cp=2, rank=0).mask[0, 0]
    assert not seam[7, :7].any() and seam[7, 7]  # the pad column attends only to itself
