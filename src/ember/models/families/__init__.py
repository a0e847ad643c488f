"""Model-family knowledge, one file per family (as torchtitan keeps `models/<family>/`).

Each family file (`llama.py`, `mistral.py`, `qwen2.py`, `qwen3.py`, `olmo2.py`, the hybrid
linear-attention `qwen3_5.py`, the vision-language `qwen2_5_vl.py`, `qwen3_vl.py` and the
mixture-of-experts `qwen3_moe.py`, `gpt_oss.py` and the hybrid
mixture-of-experts `qwen3_5_moe.py`) builds one `ModelFamily` (`base.py`): its
tensor-parallel plan, LoRA target modules, direct-decode layer, sliding-window rule,
value-head export class, tiny-model config and, for a vision-language model, its
`VisionFamily` (placeholder tokens, the tower, the transformers class), for a
mixture-of-experts model its `MoeLayout` (experts, router). `FAMILIES` maps the family's
name (a `config.model_type`) to it; `family_of` also knows each family's other model types
(`ModelFamily.config_types`).

Adding a family is one new file here plus its line in `_MODULES` (and its tests).
"""

from __future__ import annotations

from typing import Any

from ember.models.families import (
    gpt_oss,
    llama,
    mistral,
    olmo2,
    qwen2,
    qwen2_5_vl,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_vl,
)
from ember.models.families.base import (
    LLAMA_TP_PLAN,
    DecodeOps,
    DirectDecode,
    LoraTargets,
    ModelFamily,
    MoeLayout,
    TensorParallelPlan,
    TinyChat,
    VisionFamily,
)

__all__ = [
    "FAMILIES",
    "LLAMA_TP_PLAN",
    "DecodeOps",
    "DirectDecode",
    "LoraTargets",
    "ModelFamily",
    "MoeLayout",
    "TensorParallelPlan",
    "TinyChat",
    "VisionFamily",
    "direct_decode_families",
    "family_of",
    "lora_targets",
    "linear_attention_layers",
    "moe_families",
    "moe_of",
    "non_full_attention_layers",
    "tp_families",
    "uses_sliding_window",
    "vision_families",
    "vision_of",
]

_MODULES = (llama, mistral, qwen2, qwen3, olmo2, qwen2_5_vl, qwen3_vl, qwen3_moe, gpt_oss, qwen3_5, qwen3_5_moe)

FAMILIES: dict[str, ModelFamily] = {m.FAMILY.model_type: m.FAMILY for m in _MODULES}
_BY_CONFIG_TYPE: dict[str, ModelFamily] = {t: m.FAMILY for m in _MODULES for t in m.FAMILY.config_types}


def family_of(config: Any) -> ModelFamily | None:
    """The family of a transformers config (None for a model_type ember has no entry for)."""
    model_type = str(getattr(config, "model_type", ""))
    return FAMILIES.get(model_type) or _BY_CONFIG_TYPE.get(model_type)


def vision_of(config: Any) -> VisionFamily | None:
    """The vision side of a config's family; None for a text-only model."""
    family = family_of(config)
    return family.vision if family is not None else None


def moe_of(config: Any) -> MoeLayout | None:
    """The expert layout of a config's family; None for a dense model."""
    family = family_of(config)
    return family.moe if family is not None else None


def moe_families() -> tuple[str, ...]:
    return tuple(name for name, f in FAMILIES.items() if f.moe is not None)


def vision_families() -> tuple[str, ...]:
    return tuple(name for name, f in FAMILIES.items() if f.vision is not None)


def tp_families() -> tuple[str, ...]:
    return tuple(name for name, f in FAMILIES.items() if f.tp_plan is not None)


def direct_decode_families() -> tuple[str, ...]:
    return tuple(name for name, f in FAMILIES.items() if f.direct_decode)


def lora_targets(config: Any) -> LoraTargets:
    """The family's LoRA targets; Llama's names for a model_type without a family."""
    family = family_of(config)
    return family.lora if family is not None else LoraTargets()


def non_full_attention_layers(config: Any) -> list[str]:
    """The layer types of `config.layer_types` other than full attention (sorted, unique)."""
    layer_types = getattr(config, "layer_types", None) or []
    return sorted({t for t in layer_types if t != "full_attention"})


def linear_attention_layers(config: Any) -> list[int]:
    """Indices of the layers that are linear attention (Gated DeltaNet: a recurrent state per
    sequence, not a KV cache); a vision-language config's decoder is read. Empty for a
    transformer whose layers all attend."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [i for i, t in enumerate(getattr(text, "layer_types", None) or []) if t == "linear_attention"]


def uses_sliding_window(config: Any) -> bool:
    """True when some layer attends through a window rather than to the whole sequence."""
    if non_full_attention_layers(config):
        return True
    family = family_of(config)
    window_on = (family is not None and family.window_when_set) or getattr(config, "use_sliding_window", False)
    return bool(getattr(config, "sliding_window", None) and window_on)
