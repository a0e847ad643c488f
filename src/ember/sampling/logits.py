"""Next-token selection for a batch of rows, each with its own sampling parameters.

Pure tensor functions. Every row carries its own temperature, top-k, top-p and uniform
draw `u`, so one call serves a batch that mixes requests. Sampling is by inverse CDF:
the token is the first one whose cumulative probability exceeds `u * total`, which makes
the draw a deterministic function of (logits, parameters, u) — with `u` from
`ember.sampling.rng`, a function of (seed, sample, step) and nothing else.

Order of the filters (as in vLLM): temperature, then top-k, then top-p on the
top-k-renormalised distribution; the most likely token is always kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowParams:
    """Per-row sampling parameters as tensors on the logits' device."""

    temperature: torch.Tensor  # [N] float32; 0 → greedy
    top_k: torch.Tensor  # [N] int64; vocabulary size when off
    top_p: torch.Tensor  # [N] float32
    greedy: torch.Tensor  # [N] bool
    all_greedy: bool
    any_filter: bool  # some row has top_k < V or top_p < 1


@dataclass
class Draw:
    tokens: torch.Tensor  # [N] int64
    raw_logprobs: torch.Tensor  # [N, V] float32: log_softmax of the logits
    processed_logprob: torch.Tensor  # [N] float32: logprob of the token under the sampled distribution


def _kept_sorted(scaled: torch.Tensor, p: RowParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorted order, sorted probabilities, and which of them top-k/top-p keep."""
    vals, order = scaled.sort(dim=-1, descending=True, stable=True)
    probs = torch.softmax(vals, dim=-1)
    ranks = torch.arange(vals.shape[-1], device=vals.device)
    keep = ranks[None, :] < p.top_k[:, None]
    pk = probs * keep
    pk = pk / pk.sum(dim=-1, keepdim=True)
    # Keep a token while the mass strictly before it is below top_p: the smallest prefix
    # whose mass reaches top_p.
    keep = keep & ((pk.cumsum(dim=-1) - pk) < p.top_p[:, None])
    keep[:, 0] = True
    return order, probs, keep


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index drawn from unnormalised non-negative `weights` [N, V] with uniforms u [N]; and its probability."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    # target < total strictly, so the first cdf entry above it is a token of positive weight.
    target = torch.minimum(u.to(cdf.dtype)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    pos = torch.searchsorted(cdf, target, right=True).clamp_(max=weights.shape[-1] - 1)
    prob = weights.gather(1, pos) / total
    return pos.squeeze(1), prob.squeeze(1)


def draw_tokens(logits: torch.Tensor, p: RowParams, u: torch.Tensor) -> Draw:
    """Pick one token per row of `logits` [N, V] (any float dtype; computed in fp32)."""
    logits = logits.float()
    raw = torch.log_softmax(logits, dim=-1)
    greedy_tok = logits.argmax(dim=-1)
    if p.all_greedy:
        return Draw(greedy_tok, raw, torch.zeros_like(greedy_tok, dtype=torch.float32))
    temp = torch.where(p.greedy, torch.ones_like(p.temperature), p.temperature)
    scaled = logits / temp[:, None]
    if p.any_filter:
        order, probs, keep = _kept_sorted(scaled, p)
        pos, prob = _inverse_cdf(probs * keep, u)
        tok = order.gather(1, pos[:, None]).squeeze(1)
    else:
        tok, prob = _inverse_cdf(torch.softmax(scaled, dim=-1), u)
    tokens = torch.where(p.greedy, greedy_tok, tok)
    processed = torch.where(p.greedy, torch.zeros_like(prob), prob.log())
    return Draw(tokens, raw, processed)


def processed_logprobs(logits: torch.Tensor, p: RowParams) -> torch.Tensor:
    """log of the distribution actually sampled from, [N, V] (-inf outside its support)."""
    logits = logits.float()
    n, v = logits.shape
    out = torch.full((n, v), float("-inf"), device=logits.device)
    temp = torch.where(p.greedy, torch.ones_like(p.temperature), p.temperature)
    scaled = logits / temp[:, None]
    order, probs, keep = _kept_sorted(scaled, p)
    kept = probs * keep
    out.scatter_(1, order, (kept / kept.sum(dim=-1, keepdim=True)).log())
    greedy_rows = torch.full((n, v), float("-inf"), device=logits.device)
    greedy_rows.scatter_(1, logits.argmax(dim=-1, keepdim=True), 0.0)
    return torch.where(p.greedy[:, None], greedy_rows, out)


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely (token ids, logprobs) of each row, most likely first."""
    k = min(k, logprobs.shape[-1])
    vals, ids = torch.topk(logprobs, k, dim=-1)
    return ids, vals
