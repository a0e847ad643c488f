"""A peft LoRA adapter directory written from tensors: the one writer behind sampler
weights (`save_weights_for_sampler`), exports (`ember.engine.hf_export`) and the vLLM
sampler's adapter versions (`ember.sampling.vllm_versions`).

    write_peft_adapter(out, tensors, rank=16, alpha=32, base_model="Qwen/Qwen3-0.6B")

writes `adapter_config.json` (peft's own `LoraConfig.save_pretrained`: LoRA without
dropout or bias, scale alpha/rank, `target_modules` the module suffixes the tensors
belong to) and `adapter_model.safetensors` (`tensors` as given, on CPU, dtype kept).
Its readers: `peft.PeftModel.from_pretrained(base, out)`, vLLM's `LoRARequest(path=out)`
(which reads peft's config), and ember's sampler checkpoints (`read_sampler_weights`,
which reads the safetensors only). `tensors` hold peft's saved-adapter names
(`base_model.model.<module>.lora_A.weight`); other tensors (a head saved with
`modules_to_save`) ride along.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import safetensors.torch
import torch

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def adapter_target_modules(adapter_names: Iterable[str], target_parameters: Sequence[str] = ()) -> list[str]:
    """The module suffixes (`q_proj`, ...) an adapter's tensors belong to, sorted; the
    tensors of a module that holds `target_parameters` (peft's 3-D expert weights, e.g.
    `mlp.experts.gate_up_proj`: the module `mlp.experts`, or its nested `.base_layer`)
    are not modules of their own."""
    holders = tuple("." + p.rsplit(".", 1)[0] for p in target_parameters)
    targets, any_lora = set(), False
    for name in adapter_names:
        for suffix in _LORA_SUFFIXES:
            if name.endswith(suffix):
                any_lora = True
                module = name[: -len(suffix)]
                while module.endswith(".base_layer"):
                    module = module[: -len(".base_layer")]
                if not (holders and module.endswith(holders)):
                    targets.add(module.rsplit(".", 1)[-1])
    if not any_lora:
        raise ValueError("the adapter holds no lora_A/lora_B tensors")
    return sorted(targets)


def write_peft_adapter(out: Path, tensors: Mapping[str, torch.Tensor], *, rank: int, alpha: int,
                       base_model: str | None = None, task_type: str = "CAUSAL_LM",
                       modules_to_save: Sequence[str] | None = None, exclude_modules: str | None = None,
                       target_parameters: Sequence[str] | None = None) -> None:
    """`out` as a peft LoRA adapter directory holding `tensors` (see the module docstring);
    `exclude_modules` (peft's regex) keeps the target suffixes off a vision tower;
    `target_parameters` (peft's) names adapted 3-D expert weights (`ember.models.experts`)."""
    from peft import LoraConfig

    targets = adapter_target_modules(tensors, target_parameters or ())  # before anything is written
    extra = {"exclude_modules": exclude_modules} if exclude_modules is not None else {}
    if target_parameters:
        extra["target_parameters"] = list(target_parameters)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none", target_modules=targets,
                        base_model_name_or_path=base_model, task_type=task_type,
                        modules_to_save=list(modules_to_save) if modules_to_save else None, **extra)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    on_cpu = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
    safetensors.torch.save_file(on_cpu, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
