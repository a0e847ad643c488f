"""Batch-invariant numerics: the trainer and TorchSampler compute bitwise equal logprobs
(`EngineConfig.batch_invariant`, `SamplerConfig.batch_invariant`; docs/architecture.md#batch-invariant-mode).

Why the two sides differ otherwise: the trainer runs one forward over a whole (packed)
sequence, the sampler prefills a left-padded prompt batch and then decodes one token per
row over a KV cache, in batches whose size changes every step. Each reduction (a matmul's
dot products, a norm's mean, a softmax's sum, attention's weighted sum) is then computed
by a kernel that chooses its blocking, vector lanes and threads from the shape of the
whole call, so the same row reduces in a different order, and a few elementwise kernels
(silu, sigmoid, rsqrt) round an element differently in the vectorised body than in the
scalar tail of a loop. Same idea as Thinking Machines' batch-invariant kernels: make every
row's arithmetic independent of what else is in the call.

What this module does instead, on any device (pure tensor ops, no custom kernel):

* every reduction is `tree_sum`: zero-pad the reduced axis to a power of two and add its
  halves until one element is left. Only elementwise adds, so the order of each row's
  sum is fixed by its length alone, and padding with more zeros changes nothing
  (x + 0 == x): a row reduces identically whatever the number of rows or columns beside it;
* matmuls are elementwise products then `tree_sum` over K (`invariant_mm`);
* softmax / log-softmax subtract the row max (exact), exponentiate, `tree_sum`;
* silu, sigmoid and rsqrt are written as exp / add / div / sqrt, whose results do not
  depend on an element's place in the tensor (IEEE-rounded, or exp's position-independent
  kernel on this CPU build: checked by tests/models/test_models_batch_invariant.py);
* attention (`attention`, registered with transformers as `ATTENTION`): each query's own
  allowed keys are compacted to ranks 0, 1, ... in key order, so query p of a sequence
  sees exactly its p + 1 keys at the same indices whether they come from a training row
  (causal or packed mask), a left-padded prefill or a decode step over a slot cache.

`BatchInvariantMode` (torch's documented `TorchDispatchMode` extension point) replaces the
aten ops above for the forwards that run under it, on the current thread only; the model
must use `ATTENTION` as its attn_implementation (`use_batch_invariant_attention`), and any
SDPA kernel met under the mode raises. Cost: the [M, N, K] products of each matmul are
materialised (in row chunks), so a forward is one to two orders of magnitude slower than
BLAS (benchmarks/batch_invariant.py). A GPU needs real batch-invariant kernels (a matmul
with a fixed split-K and tile, attention with a fixed KV split, row-local norms):
not built here, and the mode is not tested on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

ATTENTION = "ember_batch_invariant"  # the transformers attn_implementation name
CHUNK_ELEMENTS = 1 << 22  # products held at once by one matmul chunk (16 MiB in fp32)

aten = torch.ops.aten


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum over `dim` by halving a zero-padded power-of-two axis (see module docstring)."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    if n == 0:
        out = x.new_zeros(x.shape[:-1])
    else:
        width = 1 << (n - 1).bit_length()
        if width != n:
            x = F.pad(x, (0, width - n))
        while x.shape[-1] > 1:
            half = x.shape[-1] // 2
            x = x[..., :half] + x[..., half:]
        out = x[..., 0]
    return out.unsqueeze(dim) if keepdim else out


def invariant_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N], each output element a `tree_sum` of its K products; rows and
    columns in chunks of at most `CHUNK_ELEMENTS` products (chunks do not change values)."""
    m, k = a.shape
    n = b.shape[1]
    bt = b.t()
    cols = max(1, min(n, CHUNK_ELEMENTS // max(k, 1)))
    rows = max(1, CHUNK_ELEMENTS // max(k * cols, 1))
    out = a.new_empty((m, n), dtype=torch.result_type(a, b))
    for r in range(0, m, rows):
        for c in range(0, n, cols):
            out[r:r + rows, c:c + cols] = tree_sum(a[r:r + rows, None, :] * bt[None, c:c + cols, :], -1)
    return out


def invariant_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.stack([invariant_mm(a[i], b[i]) for i in range(a.shape[0])]) if a.shape[0] else a.new_empty(
        (0, a.shape[1], b.shape[2]))


def _row_max(x: torch.Tensor, dim: int) -> torch.Tensor:
    m = x.amax(dim, keepdim=True)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a fully masked row: exp gives 0s


def invariant_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    e = (x - _row_max(x, dim)).exp()
    s = tree_sum(e, dim, keepdim=True)
    return torch.where(s > 0, e / s, torch.zeros_like(e))


def invariant_log_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    shifted = x - _row_max(x, dim)
    return shifted - tree_sum(shifted.exp(), dim, keepdim=True).log()


def _sum(x: torch.Tensor, dims, keepdim: bool) -> torch.Tensor:
    dims = sorted(d % x.dim() for d in (dims if dims else range(x.dim())))
    moved = x.movedim(dims, list(range(x.dim() - len(dims), x.dim())))
    flat = moved.reshape(*moved.shape[:x.dim() - len(dims)], -1)
    out = tree_sum(flat, -1)
    if keepdim:
        for d in dims:
            out = out.unsqueeze(d)
    return out


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + (-x).exp())


def _float(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _sum_op(x, dims=None, keepdim=False, dtype=None):
    if dtype is not None:
        x = x.to(dtype)
    return _sum(x, dims, keepdim)


def _mean_op(x, dims=None, keepdim=False, dtype=None):
    if dtype is not None:
        x = x.to(dtype)
    dims_ = dims if dims else range(x.dim())
    count = 1
    for d in dims_:
        count *= x.shape[d]
    return _sum(x, dims, keepdim) / count


def _addmm(bias, a, b, beta=1, alpha=1):
    prod = invariant_mm(a, b)
    prod = prod if alpha == 1 else prod * alpha
    return prod + (bias if beta == 1 else bias * beta)


def _baddbmm(bias, a, b, beta=1, alpha=1):
    prod = invariant_bmm(a, b)
    prod = prod if alpha == 1 else prod * alpha
    return prod + (bias if beta == 1 else bias * beta)


def _softmax(x, dim, half_to_float):
    return invariant_softmax(x.float() if half_to_float else x, dim)


def _log_softmax(x, dim, half_to_float):
    return invariant_log_softmax(x.float() if half_to_float else x, dim)


_REPLACED = {
    aten.mm.default: invariant_mm,
    aten.addmm.default: _addmm,
    aten.bmm.default: invariant_bmm,
    aten.baddbmm.default: _baddbmm,
    aten._softmax.default: _softmax,
    aten._log_softmax.default: _log_softmax,
    aten.sum.dim_IntList: _sum_op,
    aten.mean.dim: _mean_op,
    aten.silu.default: lambda x: x / (1.0 + (-x).exp()),
    aten.sigmoid.default: _sigmoid,
    aten.rsqrt.default: lambda x: 1.0 / x.sqrt(),
}
_REFUSED = {
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
}


class BatchInvariantMode(TorchDispatchMode):
    """Under this mode (on the current thread) the reductions, softmaxes and position-
    dependent elementwise ops of floating tensors run as this module's row-invariant
    versions; everything else runs as usual. Autograd sits above it: gradients use the
    same kernels and keep their usual formulas."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _REFUSED:
            raise RuntimeError(f"batch_invariant: {func} is not batch-invariant; the model must use "
                               f"attn_implementation={ATTENTION!r} (use_batch_invariant_attention)")
        fn = _REPLACED.get(func)
        if fn is not None and _float(args[0]) and all(not isinstance(a, torch.Tensor) or _float(a) for a in args):
            return fn(*args, **kwargs)
        if func.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd):
            # Under inference_mode composite ops (linear, matmul, softmax.int) reach the mode
            # whole: decompose them, with the mode on, into the ops replaced above.
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """`BatchInvariantMode` when `enabled`, else nothing."""
    if not enabled:
        yield
        return
    with BatchInvariantMode():
        yield


def _allowed(mask: torch.Tensor | None, tq: int, tk: int, device: torch.device) -> torch.Tensor:
    """The attention mask as booleans [B or 1, 1 or H, Tq, Tk] (True: attend)."""
    if mask is None:  # plain causal, the queries being the last tq keys
        q = torch.arange(tk - tq, tk, device=device)
        return (torch.arange(tk, device=device)[None, :] <= q[:, None])[None, None]
    if mask.dtype == torch.bool:
        return mask[..., :tk]
    return mask[..., :tk] == 0  # an additive mask: 0 where allowed, a large negative elsewhere


def attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (query [B, H, Tq, D], key/value
    [B, Hkv, Tk, D]) -> ([B, Tq, H, D], None). Each query's allowed keys are compacted to
    ranks 0..n-1 in key order before its dot products, softmax and weighted sum, all by
    `tree_sum`: the result for a query depends on its own prefix only."""
    if dropout:
        raise ValueError("batch_invariant attention: dropout must be 0 (the engine runs the model in eval mode)")
    b, h, tq, d = query.shape
    tk = key.shape[2]
    groups = h // key.shape[1]
    key = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    value = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    scale = d ** -0.5 if scaling is None else scaling
    allowed = _allowed(attention_mask, tq, tk, query.device).expand(b, h, tq, tk)
    rank = allowed.long().cumsum(-1) - 1
    width = max(int(allowed.sum(-1).max()), 1) if allowed.numel() else 1
    dump = torch.where(allowed, rank, torch.full_like(rank, width))  # disallowed keys go to a dropped column
    cols = torch.zeros((b, h, tq, width + 1), dtype=torch.long, device=query.device)
    cols.scatter_(-1, dump, torch.arange(tk, device=query.device).expand(b, h, tq, tk))
    valid = torch.zeros((b, h, tq, width + 1), dtype=torch.bool, device=query.device)
    valid.scatter_(-1, dump, allowed)
    cols, valid = cols[..., :width], valid[..., :width]
    out = query.new_empty((b, h, tq, d))
    for i in range(tq):  # one query position at a time bounds the [B, H, width, D] products
        k_i = key.gather(2, cols[:, :, i, :, None].expand(b, h, width, d))
        v_i = value.gather(2, cols[:, :, i, :, None].expand(b, h, width, d))
        scores = tree_sum(query[:, :, i, None, :] * k_i, -1) * scale
        scores = scores.masked_fill(~valid[:, :, i], float("-inf"))
        probs = invariant_softmax(scores.float(), -1).to(value.dtype)
        out[:, :, i] = tree_sum(probs[..., None] * v_i, -2)
    return out.transpose(1, 2).contiguous(), None


def _mask(*args, **kwargs):
    """transformers' SDPA mask builder, always materialised (never skipped as "causal"), so
    `attention` sees packed and padded sequences' boundaries."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register `attention` and its mask builder under `ATTENTION` (idempotent), through
    transformers' documented `AttentionInterface` / `AttentionMaskInterface`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, _mask)


def use_batch_invariant_attention(model: torch.nn.Module) -> None:
    """Switch a transformers model (a peft wrapper's base included) to `attention`."""
    register()
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    target.set_attn_implementation(ATTENTION)
