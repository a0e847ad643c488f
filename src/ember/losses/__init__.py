"""Tinker's built-in losses: pure tensor functions, a name registry, input validation.

Semantics (docs/protocol.md §5, docs/architecture.md contract 1): every loss is a SUM over tokens
and datums, weighted per token, with no normalisation. Each function returns the
per-token loss of a packed micro-batch; the engine sums it and reports ``loss:sum``.

Typical engine use::

    spec = get_loss(loss_fn)                                   # ValueError if unknown
    config = resolve_config(loss_fn, loss_fn_config)           # defaults + checks
    inputs_i = validate_datum_inputs(loss_fn, i, n_i, raw_i, vocab_size)   # per datum
    loss_T = spec.fn(target_logprobs_T, packed_inputs, config, segment_ids_T)

A loss consumes a head's per-token output (``spec.consumes``): log-probs of the targets
for a policy, values for a scalar head (``value_mse``, ``ppo_value``, ``cross_entropy``).
"""

from ember.losses.compute import compute_loss
from ember.losses.config import resolve_config
from ember.losses.diagnostics import clip_diagnostics
from ember.losses.functions import (
    cispo,
    cross_entropy,
    dro,
    gspo,
    importance_sampling,
    ppo,
    ppo_value,
    stable_reinforce,
    value_mse,
)
from ember.losses.registry import LOSSES, UNSUPPORTED, LossSpec, get_loss
from ember.losses.validation import validate_datum_inputs

__all__ = [
    "LOSSES",
    "UNSUPPORTED",
    "LossSpec",
    "cispo",
    "clip_diagnostics",
    "compute_loss",
    "cross_entropy",
    "dro",
    "get_loss",
    "gspo",
    "importance_sampling",
    "ppo",
    "ppo_value",
    "resolve_config",
    "stable_reinforce",
    "validate_datum_inputs",
    "value_mse",
]
