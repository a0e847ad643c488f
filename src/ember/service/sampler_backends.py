"""Sampler backends: the factory that builds one per base model, and the cache that keeps them.

`SamplerFactory` is the seam a deployment fills (`LocalSamplerFactory`: samplers in this
process); `BackendCache` creates each base model's sampler on first use, loads weight
versions into it (timing each for `add_sync_listener`), and answers the per-model gauges
(`replica_stats`, `sampler_load`). Part of `SamplerManager` (`service/samplers.py`).
"""

from __future__ import annotations

import abc
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from tinker import types

from ember.sampling.base import Sampler, UnsupportedModelError
from ember.sampling.config import SamplerConfig
from ember.service.api import UserError
from ember.service.model_registry import BaseModel, ModelRegistry

# SamplerManager's logger (this module is part of it): operators filter every sampling line by one name
log = logging.getLogger("ember.service.samplers")


class SamplerFactory(abc.ABC):
    """Builds the sampling backend of one base model (seam for remote/vLLM samplers)."""

    @abc.abstractmethod
    def create(self, base: BaseModel) -> Sampler:
        """A `ember.sampling.Sampler` serving `base`."""

    def resolved_config(self, base: BaseModel, gpu_total_bytes: int | None = None) -> SamplerConfig | None:
        """The `SamplerConfig` `create(base)` would use, when this factory has one (a local
        sampler's, for the server's memory planning); None otherwise (the default)."""
        return None

    def check(self, base: BaseModel) -> None:
        """Raise `UnsupportedModelError` when `create(base)` would get a backend that cannot
        serve `base` (called at start-up for registered models). Default: no check."""

    def syncs_saved(self) -> bool:
        """Whether a named `save_weights_for_sampler` also hands the run's tensors to the
        sampler, so that sampling from the saved path reads no file back (the memory
        transport, `SamplerConfig.weight_sync="memory"`). Default: no."""
        return False


class LocalSamplerFactory(SamplerFactory):
    """Samplers in this process, of the backend `SamplerConfig.backend` names (registry).

    Settings left to follow the trainer are filled in per base model: device, dtype and
    logprob_chunk_tokens from the training engine's config, max_len from the model's max_position_embeddings
    (`ember.sampling.resolve_sampler_config`). Backends that keep versions on disk (vLLM)
    write them under `scratch_dir`.
    """

    def __init__(self, config: Any = None, engine_config: Any = None, scratch_dir: Path | None = None) -> None:
        self.config = config
        self.engine_config = engine_config
        self.scratch_dir = scratch_dir

    def resolved_config(self, base: BaseModel, gpu_total_bytes: int | None = None) -> SamplerConfig:
        """The sampler's config for `base`; `gpu_total_bytes`: the GPU's size for a derived
        vLLM memory share (default: asked of the device, only when one is derived)."""
        from ember.engine.config import EngineConfig
        from ember.sampling import resolve_sampler_config

        engine = self.engine_config or EngineConfig()
        # the trainer's device with its index, and the dtype it computes in (autocast or params)
        config = resolve_sampler_config(self.config, device=engine.device, dtype=engine.autocast_dtype or engine.dtype,
                                        max_position_embeddings=max_positions(base.directory),
                                        logprob_chunk_tokens=engine.logprob_chunk_tokens)
        share = derived_vllm_share(config, engine, base.directory, gpu_total_bytes)
        return resolve_sampler_config(config, device=config.device, dtype=config.dtype, gpu_memory_utilization=share)

    def check(self, base: BaseModel) -> None:
        from ember.sampling.registry import check_model

        check_model(base.directory, self.resolved_config(base))

    def syncs_saved(self) -> bool:
        from ember.sampling.transport.pool import MemoryTransport

        return self.config is not None and self.config.weight_sync == MemoryTransport.mode

    def create(self, base: BaseModel) -> Sampler:
        from ember.sampling import create_sampler

        return create_sampler(base.directory, self.resolved_config(base), scratch_dir=self.scratch_dir)


def derived_vllm_share(config: Any, engine: Any, model_dir: Path, gpu_total_bytes: int | None = None) -> float | None:
    """The vLLM memory share a CUDA vLLM sampler left to derive gets (None otherwise):
    `ember.engine.estimate.vllm_memory_share` of the trainer's estimate beside it, on the
    GPU of `gpu_total_bytes` (default: the device's own total)."""
    from ember.engine.config import cuda_index
    from ember.engine.estimate import trainer_bytes_beside_sampler, vllm_memory_share

    if config.backend != "vllm" or config.gpu_memory_utilization is not None or cuda_index(config.device) is None:
        return None
    shares = any(cuda_index(d) == cuda_index(engine.device) for d in (config.devices or [config.device]))
    try:
        trainer = trainer_bytes_beside_sampler(model_dir, engine, config.colocate) if shares else 0
    except Exception as exc:  # noqa: BLE001 - an architecture the estimator does not know: the fixed default
        log.warning("vLLM memory share: no estimate for %s (%s); using the default", model_dir, exc)
        return None
    if gpu_total_bytes is None:
        gpu_total_bytes = int(torch.cuda.mem_get_info(torch.device(config.device))[1])
    return vllm_memory_share(gpu_total_bytes, trainer, shares_device=shares)


def max_positions(model_dir: Path) -> int | None:
    """`max_position_embeddings` from the model's config.json (None when absent or unreadable)."""
    try:
        value = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) and value > 1 else None


class BackendCache:
    """One sampler per base model directory, created on first use and kept until `close`."""

    def __init__(self, factory: SamplerFactory, registry: ModelRegistry) -> None:
        self.factory, self.registry = factory, registry
        self._samplers: dict[Path, Any] = {}
        self._names: dict[Path, str] = {}  # base model directory -> its name (metrics labels)
        self._lock = threading.RLock()  # held while a sampler is created (minutes): nothing else waits on it
        self._sync_listeners: list[Callable[[str, float], None]] = []

    def backend(self, base: BaseModel) -> Sampler:
        with self._lock:
            sampler = self._samplers.get(base.directory)
            if sampler is None:
                start = time.monotonic()
                try:
                    sampler = self._samplers[base.directory] = self.factory.create(base)
                    self._names[base.directory] = base.name
                except UnsupportedModelError as exc:  # the model asked for, not ember, is the cause
                    raise UserError(f"base model {base.name!r}: the sampler backend cannot serve it: {exc}") from exc
                log.info("sampler loaded for base model %s (%s, %.1f s)", base.name, type(sampler).__name__,
                         time.monotonic() - start)
            return sampler

    def replica_stats(self) -> dict[str, list[dict]]:
        """Per base model served by a pool of replicas: each replica's `up` and
        `requests_total` (`SamplerPool.replica_stats`); models with one sampler are absent."""
        # No lock: creating a sampler holds it for minutes, and a scrape must not wait for that.
        samplers = dict(self._samplers).items()  # a dict copy is atomic under the GIL
        stats = {self._names.get(d, str(d)): s.replica_stats() for d, s in samplers}
        return {name: per_replica for name, per_replica in stats.items() if per_replica is not None}

    def started(self) -> dict[str, Any]:
        """Base model name -> its started sampler backend (`SamplerManager.debug_state`)."""
        samplers = dict(self._samplers).items()  # a dict copy is atomic under the GIL
        return {self._names.get(d, str(d)): s for d, s in samplers}

    def sampler_load(self) -> dict[str, dict[str, int]]:
        """Per base model whose sampler reports it (`TorchSampler.load`): sequences decoding
        now and requests waiting for a slot. Read-only: /metrics reports it."""
        samplers = dict(self._samplers).items()  # no lock, as replica_stats
        loads = {self._names.get(d, str(d)): s.load() for d, s in samplers}
        return {name: load for name, load in loads.items() if load is not None}

    def check_registered(self) -> None:
        """Refuse to start (ValueError naming model, field and what is supported) when a
        registered model cannot be served by the sampler backend: at start-up, not at the
        first sample (`Sampler.check_model`)."""
        for name in self.registry.names():
            try:
                self.factory.check(self.registry.resolve(name))
            except UnsupportedModelError as exc:
                raise ValueError(f"model {name!r}: the sampler backend cannot serve it: {exc}") from exc

    def add_sync_listener(self, listener: Callable[[str, float], None]) -> None:
        """Call `listener(mode, seconds)` after every new version reaches a sampler: mode
        "memory" for a run's tensors handed over, "files" for a checkpoint read from disk
        (the server's `ember_weight_sync_seconds` histogram)."""
        self._sync_listeners.append(listener)

    def load(self, base: BaseModel, weights: Iterable[tuple[str, torch.Tensor]], lora: types.LoraConfig | None,
             mode: str = "memory", start: float | None = None):
        start = time.monotonic() if start is None else start
        version = self.backend(base).load_weights(weights, lora)
        for listener in self._sync_listeners:
            listener(mode, time.monotonic() - start)
        return version

    def sleep_all(self) -> None:
        """Colocation: every sampler that shares the trainer's GPU releases it (backends
        without a sleep mode ignore this); each wakes on its next request."""
        with self._lock:
            samplers = list(self._samplers.values())
        for sampler in samplers:
            sampler.sleep()

    def close(self) -> None:
        with self._lock:
            samplers, self._samplers = list(self._samplers.values()), {}
        for s in samplers:
            try:
                s.close()
            except Exception:  # noqa: BLE001
                log.exception("closing a sampler failed")
