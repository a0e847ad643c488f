"""Optional, cheap RL diagnostics (no gradients): how many tokens the clip acted on.

Metric keys follow Tinker's ``name:reduction`` rule and use ``sum`` so that merging
across micro-batches, ranks and SDK chunks stays exact. Not part of ``loss:sum``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ember.losses import functions
from ember.losses.config import ConfigIn, resolve_config


def _ratio_T(
    name: str,
    logp_T: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    segment_ids: torch.Tensor | None,
) -> torch.Tensor:
    q_T = inputs["logprobs"].to(logp_T)
    if name != "gspo":
        return torch.exp(logp_T - q_T)
    mask_T = inputs["sequence_ratio_mask"].to(logp_T)
    return torch.exp(functions.gspo_sequence_log_ratio(logp_T, q_T, mask_T, segment_ids))


@torch.no_grad()
def clip_diagnostics(
    name: str,
    target_logprobs: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    config: ConfigIn,
    segment_ids: torch.Tensor | None,
) -> dict[str, float]:
    """``{"clipped_tokens:sum": n}`` for ppo / gspo / cispo; ``{}`` for other losses.

    ppo / gspo: tokens whose clipped branch wins the min and so get no gradient
    (A > 0 and ratio > high, or A < 0 and ratio < low). cispo: tokens with A ≠ 0 whose
    importance weight was clipped (they keep a gradient, with the clipped weight).
    """
    if name not in ("ppo", "gspo", "cispo"):
        return {}
    resolved = resolve_config(name, config)
    low, high = resolved["clip_low_threshold"], resolved["clip_high_threshold"]
    logp_T = target_logprobs.detach().to(torch.promote_types(target_logprobs.dtype, torch.float32))
    ratio_T = _ratio_T(name, logp_T, inputs, segment_ids)
    adv_T = inputs["advantages"].to(logp_T)
    if name == "cispo":
        clipped_T = (adv_T != 0) & ((ratio_T < low) | (ratio_T > high))
    else:
        clipped_T = ((adv_T > 0) & (ratio_T > high)) | ((adv_T < 0) & (ratio_T < low))
    return {"clipped_tokens:sum": float(clipped_T.sum())}
