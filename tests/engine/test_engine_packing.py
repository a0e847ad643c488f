"""Packed micro-batches never let one sequence attend to another."""

import torch

from ember.engine import EngineConfig, TorchEngine
from helpers.datums import random_sft_datums
from ember.models import load_model


def test_packed_logprobs_equal_single_sequence_forwards(tiny_model_dir):
    datums = random_sft_datums(6, vocab=84, min_len=1, max_len=20, seed=5)
    engine = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(micro_batch_tokens=10_000))
    out = engine.forward(datums, "cross_entropy")
    assert engine.status().accumulated_micro_batches == 0  # forward accumulates nothing
    model = load_model(tiny_model_dir)
    for d, o in zip(datums, out.loss_fn_outputs):
        ids = torch.tensor([d.model_input.to_ints()])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
        targets = d.loss_fn_inputs["target_tokens"].to_torch()
        expected = logp.gather(1, targets.unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(o["logprobs"].to_torch(), expected, rtol=1e-5, atol=1e-5)
        assert o["logprobs"].shape == list(targets.shape)


def test_forward_leaves_no_gradient_and_no_change(tiny_model_dir):
    datums = random_sft_datums(3, vocab=84, seed=2)
    engine = TorchEngine.from_pretrained(tiny_model_dir)
    a = engine.forward(datums, "cross_entropy")
    assert all(p.grad is None for p in engine.state_tensors().values())
    b = engine.forward(datums, "cross_entropy")
    assert a.metrics == b.metrics


def test_pack_rows_first_fit_decreasing():
    from ember.engine.batching import pack_rows

    lengths = [5, 3, 8, 2, 2, 6]
    rows = pack_rows(lengths, width=8)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 8 for r in rows)
    assert len(rows) == 4  # 26 tokens need at least 4 rows of 8


def test_single_row_and_multi_row_layouts_agree(tiny_model_dir):
    from ember.engine.batching import build_micro_batch, prepare_datums
    from ember.losses import get_loss

    datums = random_sft_datums(5, vocab=84, min_len=2, max_len=9, seed=8)
    items = prepare_datums(datums, get_loss("cross_entropy"), 84)
    model = load_model(tiny_model_dir)
    results = []
    for single in (False, True):
        mb = build_micro_batch(items, packed=True, single_row=single)
        assert mb.input_ids.shape[0] == (1 if single else mb.input_ids.shape[0])
        with torch.no_grad():
            logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits
        results.append(logits.flatten(0, 1)[mb.valid_index])
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)
