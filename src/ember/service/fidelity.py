"""The sampler/trainer log-prob gap of one `forward_backward`: what the trainer computes for
the sampled tokens against what the sampler reported for them (docs/architecture.md#fidelity).

For a loss that takes the sampler's log-probs `q` (`logprobs` in `loss_fn_inputs`: the RL
losses), each datum's sampled positions are compared with the trainer's log-probs `p` of the
same targets (the call's own `logprobs` output). The sampled positions are
`sampled_mask` where provenance named them (`stable_reinforce`), else the positions whose `q`
is not 0.0: recipes (tinker-cookbook's, ember's) pad the prompt's positions with 0.0, and a
sampled token's log-prob is 0.0 only if its probability rounded to 1.

Metrics, in Tinker's `name:reduction` form (present on every call of such a loss, so the
SDK's merge of chunks keeps them; 0.0 with no sampled position):

* `sampler_logprob_diff:mean` / `:max`: mean and max of |p - q| over the sampled tokens;
* `sampler_mismatch_kl:mean`: the mean of k3 = exp(p - q) - 1 - (p - q), an unbiased,
  non-negative estimate of KL(sampler || trainer) from the sampler's own tokens;
* `sampler_tokens:sum`: how many sampled tokens the figures cover.

A gap is expected when the sampler is a snapshot that training moved past (off-policy
steps) and, for the same weights, only from numerics (contract 5: fp32 CPU within 1e-4).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from tinker import types


def _sampled(datum: types.Datum, out: Mapping[str, types.TensorData]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(p, q) at the datum's sampled positions; None for a datum without sampler log-probs."""
    q_td = datum.loss_fn_inputs.get("logprobs")
    p_td = out.get("logprobs") if out is not None else None
    if q_td is None or p_td is None:
        return None
    q, p = q_td.to_torch().double().reshape(-1), p_td.to_torch().double().reshape(-1)
    if q.shape != p.shape:
        return None  # a top-K output or a value head: no per-target log-prob to compare
    mask_td = datum.loss_fn_inputs.get("sampled_mask")
    mask = mask_td.to_torch().reshape(-1) != 0 if mask_td is not None else q != 0
    return p[mask], q[mask]


def logprob_gap_metrics(data: Sequence[types.Datum], outputs: Sequence[Mapping[str, types.TensorData]]
                        ) -> dict[str, float]:
    """The gap metrics of a call (empty when no datum carries sampler log-probs)."""
    pairs = [pq for pq in map(_sampled, data, outputs) if pq is not None]
    if not pairs:
        return {}
    p = torch.cat([pq[0] for pq in pairs])
    q = torch.cat([pq[1] for pq in pairs])
    if p.numel() == 0:
        return {"sampler_logprob_diff:mean": 0.0, "sampler_logprob_diff:max": 0.0,
                "sampler_mismatch_kl:mean": 0.0, "sampler_tokens:sum": 0.0}
    log_ratio = p - q
    return {
        "sampler_logprob_diff:mean": float(log_ratio.abs().mean()),
        "sampler_logprob_diff:max": float(log_ratio.abs().max()),
        "sampler_mismatch_kl:mean": float((torch.expm1(log_ratio) - log_ratio).mean()),
        "sampler_tokens:sum": float(p.numel()),
    }
