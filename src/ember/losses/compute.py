"""`compute_loss`: look a loss up by name, resolve its config, run it."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ember.losses.config import ConfigIn, resolve_config
from ember.losses.registry import get_loss


def compute_loss(
    name: str,
    target_logprobs: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    config: ConfigIn,
    segment_ids: torch.Tensor | None,
) -> torch.Tensor:
    """Per-token loss (T,) of loss ``name`` on a packed micro-batch; total is ``.sum()``.

    ``config`` may be raw (it is resolved here; resolving is idempotent and cheap).
    Sum semantics, no normalisation — see ``ember.losses.functions``.
    """
    spec = get_loss(name)
    return spec.fn(target_logprobs, inputs, resolve_config(name, config), segment_ids)
