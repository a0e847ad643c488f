"""Weight versions of a VLLMSampler, written where vLLM can read them.

* A LoRA version is a peft adapter directory (`adapter_config.json` +
  `adapter_model.safetensors`) under the sampler's scratch directory, served by vLLM as a
  `LoRARequest` whose integer id is never reused in the process (contract 4: a handle
  pinned to an adapter id always means those tensors).
* A full fine-tuning version is a directory with one safetensors file of every parameter
  (HF names), loaded into the engine in place when a request pinned to it runs (see
  `WeightGate`). With `SamplerConfig.weight_sync="memory"` it is the same tensors kept in
  this process instead (`keep_full_version`; on the sampler's device), pushed into the
  engine through vLLM's weight-transfer API when its turn comes: no file at all.

Names and shapes are checked against the base model built on the meta device (no
memory), with the same checks as TorchSampler's versions, before anything is written.
The files are deleted when the version is garbage-collected (`weakref.finalize`).
"""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from tinker import types
from torch import nn

from ember.errors import UserError
from ember.models import LORA_ALPHA
from ember.models.adapter import ADAPTER_WEIGHTS, write_peft_adapter
from ember.sampling.base import WeightVersion
from ember.sampling.weights import _LORA_NAME, build_full_version, build_lora_version, parameter_aliases

_lora_ids = itertools.count(1)  # vLLM adapter ids: unique in the process, never reused
BASE_KEY = "base"  # the engine holds the base model's own weights (LoRA versions run on them)


def next_lora_id() -> int:
    """A vLLM adapter id never used before in this process (versions and follow slots)."""
    return next(_lora_ids)


class VLLMWeightVersion(WeightVersion):
    """A version on disk: `path` is the adapter directory (LoRA) or the weights directory
    (full); or, for a full version kept in memory, `tensors` (HF names; `path` is None)."""

    def __init__(self, sampler_id: int, path: Path | None, lora_config: types.LoraConfig | None,
                 tensors: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__(sampler_id, is_lora=lora_config is not None,
                         lora_rank=lora_config.rank if lora_config else None)
        self.path = path
        self.tensors = tensors
        self.lora_config = lora_config
        self.lora_id = next_lora_id() if lora_config else None
        self.scorer_version: WeightVersion | None = None  # the same weights in the torch scorer

    @property
    def weights_key(self) -> str:
        """Which base weights the engine must hold to serve this version."""
        return BASE_KEY if self.is_lora else f"full-{self.version_id}"

    def named_tensors(self) -> dict[str, torch.Tensor]:
        if self.tensors is not None:
            return self.tensors
        from safetensors.torch import load_file

        return load_file(self.path / (ADAPTER_WEIGHTS if self.is_lora else "model.safetensors"))


def meta_model(model_dir: str | Path) -> nn.Module:
    """The base model's module tree on the meta device: names, shapes, tied aliases; no memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _cpu(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t = t.detach()
    t = t.to(dtype=dtype) if t.is_floating_point() else t
    return t.to("cpu").contiguous()


def write_lora_version(
    sampler_id: int, model: nn.Module, named_weights: Iterable[tuple[str, torch.Tensor]],
    lora_config: types.LoraConfig, dtype: torch.dtype, max_rank: int, scratch: Path,
    refused_modules: tuple[str, ...] = (),
) -> VLLMWeightVersion:
    """`refused_modules`: module names vLLM serves no adapter on for this model (see
    `lora_refused_modules`); an adapter on one is refused here, before vLLM sees it."""
    if lora_config.rank > max_rank:
        raise UserError(f"load_weights: LoRA rank {lora_config.rank} exceeds the vLLM sampler's max_lora_rank "
                         f"{max_rank} (raise SamplerConfig.max_lora_rank)")
    items = list(named_weights)
    checked = build_lora_version(sampler_id, model, items, lora_config, torch.device("meta"), dtype, False)
    if checked.experts:  # ember writes no adapter in vLLM's fused-MoE LoRA layout
        raise ValueError(f"load_weights: the vLLM sampler backend does not serve LoRA on a mixture-of-experts "
                         f"model's experts ({next(iter(checked.experts))!r}, ...): ember does not convert expert "
                         "factors to vLLM's MoE adapter layout; train with LoraConfig(train_mlp=False) or use the "
                         "torch sampler backend")
    _check_servable(items, refused_modules, model)
    tensors = {}
    for name, t in items:
        m = _LORA_NAME.fullmatch(name)
        tensors[f"base_model.model.{m['module']}.lora_{m['ab']}.weight"] = _cpu(t, dtype)
    version = VLLMWeightVersion(sampler_id, Path(), lora_config)
    version.path = scratch / f"lora-{version.lora_id}"
    version.path.mkdir(parents=True)
    write_peft_adapter(version.path, tensors, rank=lora_config.rank, alpha=LORA_ALPHA)
    return version


def lora_refused_modules(config) -> tuple[str, ...]:
    """LoRA targets vLLM cannot serve for a model of this config: a model without a native
    vLLM implementation runs on vLLM's transformers backend (OLMo 2 in vLLM 0.32), which
    has no adapter on `lm_head`, and an adapter naming it kills the engine."""
    from vllm import ModelRegistry

    for arch in getattr(config, "architectures", None) or ():
        registered = ModelRegistry.models.get(arch)
        if registered is not None:
            return ("lm_head",) if getattr(registered, "class_name", "").startswith("Transformers") else ()
    return ()


def _check_servable(items: list[tuple[str, torch.Tensor]], refused: tuple[str, ...], model: nn.Module) -> None:
    targets = {m["module"].rsplit(".", 1)[-1] for name, _ in items if (m := _LORA_NAME.match(name))}
    bad = sorted(targets & set(refused))
    if bad:
        arch = (getattr(model.config, "architectures", None) or ["?"])[0]
        raise UserError(f"load_weights: vLLM serves {arch} through its transformers backend, which has no LoRA on "
                         f"{bad}; train with LoraConfig(train_unembed=False) or use the torch sampler backend")


def full_tensors(model: nn.Module, named_weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                 device: torch.device | str = "cpu", copy: bool = True) -> dict[str, torch.Tensor]:
    """A full version's tensors by HF name, checked against the meta model (names, shapes;
    tied aliases once), in `dtype` on `device`. `copy`: never alias the caller's memory
    (a trainer's parameters change at its next step; a version must not)."""
    items = list(named_weights)
    names = parameter_aliases(model)
    checked = build_full_version(-1, items, names, torch.device("meta"), dtype, False)
    aliases = names[0]
    tensors: dict[str, torch.Tensor] = {}
    for name, t in items:
        key = aliases[name]
        if key in checked.params and key not in tensors:  # tied aliases: one copy
            out = _cpu(t, dtype) if str(device) == "cpu" else t.detach().to(device=device, dtype=dtype).contiguous()
            tensors[key] = out.clone() if copy and out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() \
                else out
    return tensors


def write_full_version(
    sampler_id: int, model: nn.Module, named_weights: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype, scratch: Path,
) -> VLLMWeightVersion:
    tensors = full_tensors(model, named_weights, dtype, copy=False)  # the file is the copy
    version = VLLMWeightVersion(sampler_id, Path(), None)
    version.path = scratch / f"full-{version.version_id}"
    version.path.mkdir(parents=True)
    save_file(tensors, str(version.path / "model.safetensors"))
    return version


def keep_full_version(
    sampler_id: int, model: nn.Module, named_weights: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype, device: torch.device | str, copy: bool = True,
) -> VLLMWeightVersion:
    """`weight_sync="memory"`: the full version's tensors kept in this process (on the
    sampler's device: a CUDA engine maps them through IPC), nothing written."""
    return VLLMWeightVersion(sampler_id, None, None, full_tensors(model, named_weights, dtype, device, copy))


def remove_version_files(path: Path | None) -> None:
    """Delete a version's files (called when the version is garbage-collected; None: it
    had none, its tensors go with the object)."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
