"""Model-family knowledge in one place (as torchtitan keeps `models/<family>/parallelize.py`).

One `ModelFamily` per Hugging Face `config.model_type` says what ember relies on for it:

* `tp_plan`: how tensor parallelism splits a decoder layer (`ember.engine.parallel`):
  projections split column-wise / row-wise, and per-head norms that see only the local
  heads; None: no tensor parallelism for this family.
* `direct_decode`: whether the sampler's direct decode forward (`ember.sampling.decoder`)
  reproduces the family's forward; otherwise the sampler uses the transformers forward.
* `window_when_set`: a non-null `config.sliding_window` means the window is in use (Mistral);
  other families use one only with `config.use_sliding_window`.

Adding a family is one entry in `FAMILIES` (plus a `TensorParallelPlan` if its layer
differs from the Llama layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TensorParallelPlan:
    """Submodule paths of one decoder layer, relative to the layer."""

    colwise: tuple[str, ...]  # outputs split over ranks (q/k/v, gate/up)
    rowwise: tuple[str, ...]  # inputs split over ranks, outputs all-reduced (o, down)
    head_norms: tuple[str, ...] = ()  # per-head norms over the local heads (skipped where absent)


LLAMA_TP_PLAN = TensorParallelPlan(
    colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
    rowwise=("self_attn.o_proj", "mlp.down_proj"),
    head_norms=("self_attn.q_norm", "self_attn.k_norm"),  # Qwen3's; absent in Llama/Qwen2/Mistral
)


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    tp_plan: TensorParallelPlan | None = LLAMA_TP_PLAN
    direct_decode: bool = True
    window_when_set: bool = False


FAMILIES: dict[str, ModelFamily] = {
    f.model_type: f
    for f in (
        ModelFamily("llama"),
        ModelFamily("mistral", window_when_set=True),
        ModelFamily("qwen2"),
        ModelFamily("qwen3"),
    )
}


def family_of(config: Any) -> ModelFamily | None:
    """The family of a transformers config (None for a model_type ember has no entry for)."""
    return FAMILIES.get(str(getattr(config, "model_type", "")))


def tp_families() -> tuple[str, ...]:
    return tuple(name for name, f in FAMILIES.items() if f.tp_plan is not None)


def direct_decode_families() -> tuple[str, ...]:
    return tuple(name for name, f in FAMILIES.items() if f.direct_decode)


def non_full_attention_layers(config: Any) -> list[str]:
    """The layer types of `config.layer_types` other than full attention (sorted, unique)."""
    layer_types = getattr(config, "layer_types", None) or []
    return sorted({t for t in layer_types if t != "full_attention"})


def uses_sliding_window(config: Any) -> bool:
    """True when some layer attends through a window rather than to the whole sequence."""
    if non_full_attention_layers(config):
        return True
    family = family_of(config)
    window_on = (family is not None and family.window_when_set) or getattr(config, "use_sliding_window", False)
    return bool(getattr(config, "sliding_window", None) and window_on)
