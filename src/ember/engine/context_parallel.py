"""Context parallelism (`ParallelismConfig.cp > 1`): one long sequence split over `cp` ranks.

**Choice: Ulysses (all-to-all over heads), not ring attention.** How the peers do it:
torchtitan shards the sequence and runs *ring* attention through PyTorch's experimental
`torch.distributed.tensor.experimental.context_parallel`, which swaps
`F.scaled_dot_product_attention` for a ring implementation inside a context manager
(a dispatcher patch) and needs a load balancer (head-tail / round-robin shards) because
causal attention over contiguous shards leaves the first ranks idle; prime-rl's CP uses
`ring_flash_attn` (ring attention over flash-attention's varlen CUDA kernels, wired in
by substituting transformers' flash-attention function). Both are CUDA-first. ember
picks DeepSpeed-Ulysses's scheme because:

* it is **exact with plain sdpa on any backend** (gloo on CPU, NCCL on CUDA): after one
  all-to-all each rank holds *all* positions of `heads / cp` heads and runs ordinary
  softmax attention — no partial softmax merged across ranks (ring attention's
  log-sum-exp merge changes rounding), so world `cp` equals world 1 to fp32 rounding;
* **packing stays simple**: every rank sees the whole row, so the block-diagonal
  mask of packed sequences (and the padding mask) is the same mask world 1 uses, built
  once per micro-batch from the *full* position ids;
* the work is **balanced without reordering**: attention runs over the full sequence on
  every rank (1/cp of the heads each), so contiguous shards need no load balancer;
* it plugs in through transformers' supported extension point, no monkey-patching:
  `AttentionInterface.register(name, fn)` + `model.set_attn_implementation(name)`; the
  function receives the local (post-RoPE) q/k/v of its shard and a 4-D mask, which
  transformers passes through untouched (`masking_utils._preprocess_mask_arguments`).

Its limit: `cp` must divide the number of attention heads (key/value heads are repeated
first when `cp` does not divide them). Communication per layer: two all-to-alls of the
layer's q/k/v and output (O(T·H/cp) per rank), independent of `cp` per token.

Everything else in the model is token-wise (embeddings, norms, MLPs, LM head), so each
rank runs it on its shard only: activations are split `cp` ways. Positions: each shard
keeps its **true** position ids (RoPE), sliced from the micro-batch's. The head scores
only the rank's own real tokens; the per-token outputs (T floats, not logits) are then
all-gathered (`gather_token_outputs`, whose backward takes back the rank's slice), so the
loss is computed on the whole micro-batch on every rank — every loss, including
per-sequence ones, is exact. Gradients: each rank's backward covers its shard's tokens
(and, through the all-to-all's adjoint, its keys/values used by the other shards);
FSDP2 shards parameters over the flattened `(dp_shard, cp)` mesh dims and SUMs gradients
over them (torchtitan's `dp_shard_cp`), so the sum over cp ranks is the world-1 gradient.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ember.engine.batching import MicroBatch

_NAMES = itertools.count()


# ---------------------------------------------------------------------- autograd collectives
class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (cp equal chunks). Its adjoint is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)  # contiguous too (empty_like keeps a permuted input's strides)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _GatherTokens(torch.autograd.Function):
    """Every rank's real-token outputs, assembled in micro-batch order. Backward: this rank's
    slice of the gradient (every rank computes the same loss from the same gathered
    outputs, so the upstream gradient is identical everywhere; summing would count it cp times)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group, rank: int, keeps: list[torch.Tensor], total: int):
        width = max(int(k.numel()) for k in keeps)
        padded = local.new_zeros((width, *local.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in keeps]
        dist.all_gather(parts, padded.contiguous(), group=group)
        out = local.new_zeros((total, *local.shape[1:]))
        for part, keep in zip(parts, keeps):
            out[keep.to(out.device)] = part[: keep.numel()]
        ctx.keep = keeps[rank]
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.keep.to(grad.device)], None, None, None, None


# ---------------------------------------------------------------------- the attention function
def _to_full_sequence(q, k, v, group, cp: int):
    """(B, heads, S/cp, D) shards of q, k, v → (B, heads/cp, S, D) for this rank's head group."""
    b, _, s_loc, d = q.shape
    n_rep = q.shape[1] // k.shape[1]
    if k.shape[1] % cp:  # too few kv heads to split: repeat them to one per query head first
        k, v = (t.repeat_interleave(n_rep, dim=1) for t in (k, v))
        n_rep = 1
    heads = [t.shape[1] // cp for t in (q, k, v)]
    x = torch.cat([t.reshape(b, cp, h, s_loc, d) for t, h in zip((q, k, v), heads)], dim=2)
    x = _AllToAll.apply(x.transpose(0, 1), group)  # (cp = source shard, B, h, S/cp, D)
    x = x.permute(1, 2, 0, 3, 4).reshape(b, sum(heads), cp * s_loc, d)
    q, k, v = torch.split(x, heads, dim=1)
    if n_rep > 1:
        k, v = (t.repeat_interleave(n_rep, dim=1) for t in (k, v))
    return q, k, v


def _to_sequence_shard(out, group, cp: int) -> torch.Tensor:
    """(B, heads/cp, S, D) → (B, S/cp, heads, D): the inverse exchange, in transformers'
    attention-output layout."""
    b, h, s, d = out.shape
    x = out.reshape(b, h, cp, s // cp, d).permute(2, 0, 1, 3, 4)  # (cp = dest shard, B, h, S/cp, D)
    x = _AllToAll.apply(x, group)  # (cp = source head group, B, h, S/cp, D)
    return x.permute(1, 3, 0, 2, 4).reshape(b, s // cp, cp * h, d)


def ulysses_attention(group, cp: int) -> Callable:
    """A transformers attention function (`AttentionInterface` signature) for `group`."""

    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                  sliding_window=None, **_kwargs):
        if sliding_window is not None:
            raise ValueError("context parallelism does not support sliding-window attention layers")
        if query.shape[1] % cp:
            raise ValueError(f"cp={cp} must divide the attention heads ({query.shape[1]} on this rank)")
        q, k, v = _to_full_sequence(query, key, value, group, cp)
        mask = attention_mask
        if mask is not None and mask.dtype != torch.bool:
            raise ValueError("context-parallel attention expects a boolean 4-D mask (ember builds it)")
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                             is_causal=mask is None)
        return _to_sequence_shard(out, group, cp), None

    return attention


def install_attention(model: torch.nn.Module, group, cp: int) -> str:
    """Register a Ulysses attention function for `group` in transformers' registry and make
    `model` (the transformers model, not a peft wrapper) use it. Returns its registered name."""
    from transformers import AttentionInterface

    name = f"ember_ulysses_{next(_NAMES)}"
    AttentionInterface.register(name, ulysses_attention(group, cp))
    model.set_attn_implementation(name)
    return name


# ---------------------------------------------------------------------- sharding a micro-batch
@dataclasses.dataclass
class CPShard:
    """One rank's part of a micro-batch: its columns, their true positions, the full mask."""

    input_ids: torch.Tensor  # (rows, S/cp)
    position_ids: torch.Tensor  # (rows, S/cp)
    mask: torch.Tensor | None  # (rows, 1, S, S) bool, or None for plain causal
    local: MicroBatch  # valid_index/inputs restricted to this rank's real tokens
    keeps: list[torch.Tensor]  # per cp rank: which of the T real tokens it scores


def _full_mask(position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               always: bool = False) -> torch.Tensor | None:
    """The (rows, 1, S, S) boolean mask world 1 uses: causal, within a packed segment (positions
    restart at 0) or over the unpadded keys; None when it is plain causal, unless `always`."""
    s = position_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=position_ids.device).tril()
    if attention_mask is not None:
        mask = causal[None] & attention_mask.bool()[:, None, :]
    else:
        segment = torch.cumsum(position_ids == 0, dim=1)
        mask = causal[None] & (segment[:, :, None] == segment[:, None, :])
    if not always and bool(mask.eq(causal[None]).all()):
        return None
    return mask[:, None]


def _pad_columns(mb: MicroBatch, width: int, pad_id: int):
    rows, w = mb.input_ids.shape
    extra = width - w
    ids = F.pad(mb.input_ids, (0, extra), value=pad_id)
    if mb.attention_mask is None:  # packed: the added columns form a pad segment of their own
        pos = torch.cat([mb.position_ids, torch.arange(extra).expand(rows, extra)], dim=1)
        return ids, pos, None
    pos = torch.arange(width).expand(rows, width).clone()
    return ids, pos, F.pad(mb.attention_mask, (0, extra), value=0)


def shard_micro_batch(mb: MicroBatch, cp: int, rank: int, pad_id: int = 0, always_mask: bool = False) -> CPShard:
    """Split `mb`'s columns into `cp` contiguous shards (padded to a multiple of cp) and keep
    shard `rank`: the same micro-batch on every cp rank gives every rank the same plan.
    `always_mask`: a mask even where plain causal attention would do (`is_causal`), so that a
    compiled layer sees one kind of mask (`EngineConfig.compile`)."""
    rows, width = mb.input_ids.shape
    full = math.ceil(width / cp) * cp
    ids, pos, mask2d = _pad_columns(mb, full, pad_id)
    s_loc = full // cp
    row, col = mb.valid_index // width, mb.valid_index % width
    owner = col // s_loc
    keeps = [torch.nonzero(owner == r).squeeze(1) for r in range(cp)]
    keep = keeps[rank]
    local_index = row[keep] * s_loc + (col[keep] - rank * s_loc)
    local = dataclasses.replace(
        mb, input_ids=ids[:, rank * s_loc : (rank + 1) * s_loc], position_ids=pos[:, rank * s_loc : (rank + 1) * s_loc],
        attention_mask=None, valid_index=local_index, inputs={k: v[keep] for k, v in mb.inputs.items()},
        segment_ids=mb.segment_ids[keep],
    )
    return CPShard(local.input_ids, local.position_ids, _full_mask(pos, mask2d, always_mask), local, keeps)


def gather_token_outputs(local: torch.Tensor, shard: CPShard, group, rank: int) -> torch.Tensor:
    """The head's outputs for all T real tokens of the micro-batch, in order, on every cp rank."""
    total = sum(int(k.numel()) for k in shard.keeps)
    return _GatherTokens.apply(local, group, rank, shard.keeps, total)
