"""`ember.models.batch_invariant`'s kernels: each row's result is bitwise the same alone, in
a bigger batch, or padded (the property the trainer/sampler equality rests on)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.models.batch_invariant import BatchInvariantMode, attention, invariant_mm, tree_sum


def test_tree_sum_ignores_zero_padding_and_matches_sum():
    x = torch.randn(3, 37, generator=torch.Generator().manual_seed(0))
    for extra in (1, 27, 91):
        assert torch.equal(tree_sum(x), tree_sum(F.pad(x, (0, extra))))
    torch.testing.assert_close(tree_sum(x), x.sum(-1), rtol=1e-5, atol=1e-6)
    assert torch.equal(tree_sum(x, 0, keepdim=True)[0], torch.stack([tree_sum(c) for c in x.t()]))


def test_mm_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(50, 96, generator=g), torch.randn(96, 130, generator=g)
    full = invariant_mm(a, b)
    for r in (0, 17, 49):
        assert torch.equal(invariant_mm(a[r:r + 1], b)[0], full[r])
    torch.testing.assert_close(full, a @ b, rtol=1e-4, atol=1e-4)


def test_mode_makes_linear_silu_and_softmax_row_invariant():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(9, 64, generator=g) * 4, torch.randn(50, 64, generator=g)
    with BatchInvariantMode(), torch.inference_mode():
        batched = torch.log_softmax(F.silu(F.linear(x, w)), -1)
        rows = [torch.log_softmax(F.silu(F.linear(x[i:i + 1], w)), -1)[0] for i in range(9)]
        norm = torch.rsqrt(x.pow(2).mean(-1))
        norm_rows = [torch.rsqrt(x[i:i + 1].pow(2).mean(-1))[0] for i in range(9)]
    assert all(torch.equal(batched[i], r) for i, r in enumerate(rows))
    assert all(torch.equal(norm[i], r) for i, r in enumerate(norm_rows))
    torch.testing.assert_close(batched, torch.log_softmax(F.silu(x @ w.t()), -1), rtol=1e-4, atol=1e-4)


def test_sdpa_is_refused_under_the_mode():
    q = torch.randn(1, 2, 4, 8)
    with BatchInvariantMode(), pytest.raises(RuntimeError, match="attn_implementation='ember_batch_invariant'"):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_attention_query_depends_on_its_prefix_only():
    """Query p of a causal row, a left-padded row and a decode step over a longer cache
    (stale entries masked) gives the same bits; and it equals SDPA to rounding."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 6, 8, generator=g) for _ in range(3))
    kv_small = (k[:, :2], v[:, :2])  # GQA: 2 KV heads for 4 query heads
    causal = torch.ones(6, 6).tril().bool()[None, None]
    out, _ = attention(None, q, *kv_small, causal, scaling=0.5)
    pad = 3  # the same sequence left-padded by 3 columns (pads attend to themselves)
    qp, kp, vp = (F.pad(t, (0, 0, pad, 0)) for t in (q, *kv_small))
    valid = torch.arange(9) >= pad
    padded_mask = ((torch.ones(9, 9).tril().bool() & valid[None, :]) | torch.eye(9, dtype=torch.bool))[None, None]
    out_p, _ = attention(None, qp, kp, vp, padded_mask, scaling=0.5)
    assert torch.equal(out_p[:, pad:], out)
    for p in range(6):  # decode: one query over a cache of 8 positions, 0..p valid
        kc, vc = (F.pad(t[:, :, :p + 1], (0, 0, 0, 7 - p), value=7.0) for t in kv_small)
        mask = (torch.arange(8) <= p)[None, None, None]
        step, _ = attention(None, q[:, :, p:p + 1], kc, vc, mask, scaling=0.5)
        assert torch.equal(step[:, 0], out[:, p])
    ref = F.scaled_dot_product_attention(q, k[:, :2].repeat_interleave(2, 1), v[:, :2].repeat_interleave(2, 1),
                                         is_causal=True, scale=0.5)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)
