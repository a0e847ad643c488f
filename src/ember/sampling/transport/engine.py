"""How a `VLLMSampler`'s full fine-tuning versions enter its engine: one `EngineTransport`,
chosen once from `SamplerConfig.weight_sync` when the sampler is built (`engine_transport`).

* `FileEngineTransport` ("files"): a version is a safetensors file in the sampler's
  scratch directory, loaded in place by vLLM's `reload_weights` when its turn comes.
* `MemoryEngineTransport` ("memory"): a version is its tensors kept in the sampler's
  process and pushed through vLLM's weight-transfer API (`WeightPusher`: the `ember_gloo`
  engine on CPU, vLLM's `ipc` on CUDA); no file is written.

LoRA versions are adapter directories either way: vLLM 0.32 loads an adapter only from a
path (`LoRARequest.lora_path`). The base model's own weights are always read from its files.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from ember.sampling.config import SamplerConfig
from ember.sampling.vllm_versions import VLLMWeightVersion, keep_full_version, write_full_version


async def reload_from_files(llm, path: Path | str) -> None:
    """vLLM's in-place reload (the model's own load_weights, LoRA wrappers and fused layouts included)."""
    await llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})


class EngineTransport(abc.ABC):
    """A vLLM sampler's way of keeping full versions and loading them into its engine."""

    mode: ClassVar[str]  # its `SamplerConfig.weight_sync` value

    @abc.abstractmethod
    def full_version(self, sampler_id: int, model: nn.Module, named_weights: Iterable[tuple[str, torch.Tensor]],
                     dtype: torch.dtype, scratch: Path, copy: bool = True) -> VLLMWeightVersion:
        """A full version of `named_weights` (checked against the meta `model`), kept for the engine."""

    @abc.abstractmethod
    async def load_full(self, llm, version: VLLMWeightVersion, tag: str) -> None:
        """Load `version` into the running engine `llm` in place (on the sampler's event loop)."""

    def engine_options(self) -> dict:
        """Extra `AsyncEngineArgs` options the engine needs to take versions this way."""
        return {}

    async def init(self, llm) -> None:
        """Called once per engine started, before any `load_full`."""

    def close(self) -> None:
        """Release what the transport holds (the sampler is closing)."""


class FileEngineTransport(EngineTransport):
    mode = "files"

    def full_version(self, sampler_id, model, named_weights, dtype, scratch, copy=True):
        return write_full_version(sampler_id, model, named_weights, dtype, scratch)  # the file is the copy

    async def load_full(self, llm, version, tag):
        await reload_from_files(llm, version.path)


class MemoryEngineTransport(EngineTransport):
    mode = "memory"

    def __init__(self, device: str, timeout_s: float) -> None:
        from ember.sampling.vllm_weight_engine import WeightPusher

        self.device = device
        self.pusher = WeightPusher(device, timeout_s)

    def full_version(self, sampler_id, model, named_weights, dtype, scratch, copy=True):
        return keep_full_version(sampler_id, model, named_weights, dtype, self.device, copy)

    async def load_full(self, llm, version, tag):
        await self.pusher.push(llm, version.tensors, tag)

    def engine_options(self) -> dict:
        from ember.sampling.vllm_weight_engine import engine_options

        return engine_options(self.device)

    async def init(self, llm) -> None:
        await self.pusher.init(llm)

    def close(self) -> None:
        self.pusher.close()


def engine_transport(config: SamplerConfig) -> EngineTransport:
    """The transport `config.weight_sync` names, for a vLLM sampler on `config.resolved_device`."""
    if config.weight_sync == FileEngineTransport.mode:
        return FileEngineTransport()
    return MemoryEngineTransport(config.resolved_device, config.replica_timeout_s)
