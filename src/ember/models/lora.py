"""LoRA adapters through peft, configured the way Tinker's `LoraConfig` is.

Tinker's LoraConfig has `rank`, `seed`, `train_mlp`, `train_attn`, `train_unembed`.
ember maps it onto `peft.LoraConfig` with:

* `lora_alpha = 32` for every rank (the scale is alpha / rank). This is the convention of
  Tinker and "LoRA Without Regret": a fixed alpha makes the optimal learning rate roughly
  independent of the rank. It is a module constant, not a per-run knob, so checkpoints
  stay interchangeable with Tinker's.
* no dropout, no bias; A initialised from `seed` (Kaiming-uniform, peft's default) and
  B = 0, so a fresh adapter leaves the model's outputs unchanged.
* a mixture-of-experts model's fused expert weights (3-D: `mlp.experts.gate_up_proj`,
  `mlp.experts.down_proj`) are peft `target_parameters` when `train_mlp` is on: per-expert
  A/B matrices (`ember.models.experts`); the router is never adapted (it is frozen under LoRA).
"""

from __future__ import annotations

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from tinker import types
from transformers import PreTrainedModel

from ember.models.families import lora_targets, vision_of

LORA_ALPHA = 32


def lora_target_modules(model: PreTrainedModel, config: types.LoraConfig, unembed: bool = True) -> list[str]:
    """Names (suffixes) of the Linear modules that receive adapters, present in `model`.

    The names per group are the model family's (`ember.models.families`). `unembed=False`
    (a value-head run, which does not use the LM head) never targets the unembedding,
    whatever `train_unembed` says."""
    family = lora_targets(model.config)
    wanted: list[str] = []
    if config.train_attn:
        wanted += family.attn
    if config.train_mlp:
        wanted += family.mlp
    if config.train_unembed and unembed:
        wanted += family.unembed
    # Suffixes of every module: after peft wrapping, `q_proj` is a LoRA layer, no longer a Linear.
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [w for w in wanted if w in present]
    if not targets and not (config.train_mlp and family.experts):  # experts alone are targets too
        raise ValueError(
            f"LoraConfig selects no module of this model (train_attn={config.train_attn}, "
            f"train_mlp={config.train_mlp}, train_unembed={config.train_unembed}); "
            f"projection modules present: {sorted(present & set(family.attn + family.mlp + family.unembed))}"
        )
    return targets


def lora_target_parameters(model: PreTrainedModel, config: types.LoraConfig) -> list[str]:
    """peft's `target_parameters`: the family's 3-D expert weights (`LoraTargets.experts`)
    when `train_mlp` selects the MLP, [] for a dense model."""
    return list(lora_targets(model.config).experts) if config.train_mlp else []


def lora_exclude_modules(config) -> str | None:
    """peft's `exclude_modules` for a model: a vision-language model's tower (adapters go
    on the language model only; Qwen2.5-VL's tower names its MLP like the decoder's)."""
    vision = vision_of(config)
    return vision.tower_pattern if vision is not None else None


def peft_config(model: PreTrainedModel, config: types.LoraConfig, unembed: bool = True) -> PeftLoraConfig:
    if config.rank < 1:
        raise ValueError(f"LoraConfig.rank must be >= 1, got {config.rank}")
    exclude = lora_exclude_modules(model.config)
    extra = {"exclude_modules": exclude} if exclude is not None else {}
    experts = lora_target_parameters(model, config)
    if experts:
        extra["target_parameters"] = experts
    return PeftLoraConfig(
        r=config.rank,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        bias="none",
        target_modules=lora_target_modules(model, config, unembed),
        task_type="CAUSAL_LM",
        **extra,
    )


def apply_lora(model: PreTrainedModel, config: types.LoraConfig) -> PeftModel:
    """Wrap `model` with a fresh LoRA adapter; only adapter weights stay trainable."""
    seed = 0 if config.seed is None else int(config.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, peft_config(model, config))
    return peft_model


def add_lora_adapter(model: PreTrainedModel | PeftModel, name: str, config: types.LoraConfig,
                     unembed: bool = True) -> PeftModel:
    """Add a named adapter (many tenants on one base model held once in memory).

    A plain model is wrapped (its Linear modules become peft LoRA layers, in place); a
    PeftModel gets one more adapter. The caller activates it with `set_adapter(name)`.
    `unembed=False` leaves `lm_head` out of the targets (value-head runs).
    """
    seed = 0 if config.seed is None else int(config.seed)
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    cfg = peft_config(base, config, unembed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if isinstance(model, PeftModel):
            if name in model.peft_config:
                raise ValueError(f"adapter {name!r} already exists on this base model")
            model.add_adapter(name, cfg)
            return model
        return get_peft_model(model, cfg, adapter_name=name)


def remove_lora_adapter(model: PeftModel, name: str) -> None:
    """Delete a tenant's adapter and free its weights."""
    model.delete_adapter(name)
