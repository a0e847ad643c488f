"""The loss-name registry: a plain dict filled at import, one `LossSpec` per Tinker loss.

Sources for names, inputs and defaults: docs/protocol.md §5.

* ``ppo`` 0.8 / 1.2 and ``cispo`` 0.0 / 4.0: the official cookbook tutorial
  ``202_loss_functions.py`` (the PPO doc page says "fixed to 0.2", i.e. 0.8 / 1.2).
* ``gspo`` 0.8 / 1.2: Tinker's GSPO page writes the clip as (1 − ε_low, 1 + ε_high) and
  shows no numbers; we use PPO's defaults. (The GSPO paper's own ranges, 3e-4 / 4e-4,
  are ε's for a differently scaled setup; pass them explicitly if wanted.)
* ``dro`` β = 0.1: Tinker's docs only show a custom value; 0.1 follows a third-party
  Tinker-compatible reimplementation.
* ``stable_reinforce`` 0.5 / 2.0 and its inputs: ember's choice (Tinker does not publish
  the objective; see ``functions.stable_reinforce``). Its ``logprobs`` and
  ``sampled_mask`` are filled in by the service from stability records
  (``ember.service.stability``); the client sends ``target_tokens``, ``advantages`` and
  provenance spans.
* ``value_mse`` and ``ppo_value`` (ember's, for scalar-head runs): ``ppo_value``'s
  ``value_clip`` ε = 0.2 follows baselines / verl (``cliprange_value``). They consume
  values; ``target_tokens`` is accepted (the SDK's ``forward_backward_custom`` sends it)
  and ignored.

What a loss consumes (``LossSpec.consumes``): ``"logprobs"`` (a policy head's per-token
log-probs of the targets) and/or ``"values"`` (a scalar head's per-token values).
``cross_entropy`` consumes both: on a value head it is the linear surrogate −Σ w·V that
``forward_backward_custom`` relies on. There is no built-in pairwise (Bradley–Terry)
loss: a pair spans two datums, which the micro-batch planner may separate, so it could
not be a per-micro-batch sum (contract 2); train reward models with
``forward_backward_custom``, which is exact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from ember.errors import UserError
from ember.losses import functions

LossFn = Callable[
    [torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float], torch.Tensor | None],
    torch.Tensor,
]

RL_INPUTS = ("target_tokens", "logprobs", "advantages")
LOGPROBS = frozenset({"logprobs"})
VALUES = frozenset({"values"})


@dataclass(frozen=True)
class LossSpec:
    """What a loss needs: its function, its `loss_fn_inputs` keys and its config keys."""

    name: str
    fn: LossFn  # fn(target_logprobs, inputs, config, segment_ids) -> elementwise_loss (T,)
    required_inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...]
    config_defaults: Mapping[str, float]
    supports_top_k: bool = False  # target_tokens may be (N, K)
    consumes: frozenset[str] = LOGPROBS  # head outputs it takes: "logprobs" and/or "values"

    @property
    def accepted_inputs(self) -> tuple[str, ...]:
        return self.required_inputs + self.optional_inputs


def _spec(
    fn: LossFn,
    required: tuple[str, ...],
    optional: tuple[str, ...] = (),
    defaults: Mapping[str, float] | None = None,
    top_k: bool = False,
    consumes: frozenset[str] = LOGPROBS,
) -> LossSpec:
    return LossSpec(
        name=fn.__name__,
        fn=fn,
        required_inputs=required,
        optional_inputs=optional,
        config_defaults=MappingProxyType(dict(defaults or {})),
        supports_top_k=top_k,
        consumes=consumes,
    )


_PPO_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}

LOSSES: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        _spec(functions.cross_entropy, ("target_tokens",), ("weights",), top_k=True,
              consumes=LOGPROBS | VALUES),
        _spec(functions.importance_sampling, RL_INPUTS),
        _spec(functions.ppo, RL_INPUTS, defaults=_PPO_CLIP),
        _spec(
            functions.cispo,
            RL_INPUTS,
            defaults={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
        ),
        _spec(functions.dro, RL_INPUTS, defaults={"beta": 0.1}),
        _spec(functions.gspo, RL_INPUTS + ("sequence_ratio_mask",), defaults=_PPO_CLIP),
        _spec(
            functions.stable_reinforce,
            RL_INPUTS + ("sampled_mask",),
            defaults={"clip_low_threshold": 0.5, "clip_high_threshold": 2.0},
        ),
        _spec(functions.value_mse, ("returns",), ("weights", "target_tokens"), consumes=VALUES),
        _spec(
            functions.ppo_value,
            ("returns", "old_values"),
            ("weights", "target_tokens"),
            defaults={"value_clip": 0.2},
            consumes=VALUES,
        ),
    )
}

# Names the tinker SDK knows (`tinker.types.LossFnType`) that ember deliberately lacks.
UNSUPPORTED: dict[str, str] = {
    "custom": (
        "server-side custom losses (selected by loss_id) are a flag-gated Tinker feature; "
        "use TrainingClient.forward_backward_custom, which runs on cross_entropy"
    ),
}


def get_loss(name: str) -> LossSpec:
    """The `LossSpec` registered as ``name``; ``ValueError`` naming the known losses."""
    known = ", ".join(LOSSES)
    if not isinstance(name, str):
        raise UserError(f"loss_fn must be a string, got {type(name).__name__}; known: {known}")
    if name in LOSSES:
        return LOSSES[name]
    if name in UNSUPPORTED:
        raise UserError(
            f"loss_fn {name!r} is not supported by ember: {UNSUPPORTED[name]}. Supported: {known}"
        )
    raise UserError(f"unknown loss_fn {name!r}; known: {known}")
