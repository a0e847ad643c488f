"""The engine factory seam: how the service gets (and frees) a run's training engine.

The service never constructs engines itself: it asks an `EngineFactory`. The default
`LocalEngineFactory` builds in-process `TorchEngine`s — all LoRA runs of one base model
as named adapters on one shared PeftModel (the base weights are held once), each full
fine-tuning run on a private copy. A scale-out factory (e.g. one backed by
`ember.workers.WorkerGroup`) implements the same four methods and returns engines that
forward to remote workers; nothing in the service changes.

Threading contract: `create` and `release` are called on the run's lane (see
`ember.service.sequencer`), i.e. on the same thread as every op of runs sharing that
lane's key, so a factory may mutate a shared model there without further locking.
"""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass
from pathlib import Path

from tinker import types

from ember.engine.base import TrainingEngine
from ember.engine.config import EngineConfig
from ember.service.model_registry import BaseModel



@dataclass(frozen=True)
class RunSpec:
    run_id: str
    base: BaseModel
    lora_config: types.LoraConfig | None  # None = full fine-tuning
    optimizer: str = "adamw"  # the run's optimizer (`ember.engine.optimizers.OPTIMIZERS` key)
    head: str = "policy"  # what the model outputs per token (`ember.engine.heads.HEADS` key)

    @property
    def is_lora(self) -> bool:
        return self.lora_config is not None


def adapter_name(run_id: str) -> str:
    """A peft adapter name for a run (module-dict keys may not contain '.')."""
    return "run_" + re.sub(r"[^A-Za-z0-9_]", "_", run_id)


class EngineFactory(abc.ABC):
    """Creates and releases training engines for the service."""

    @abc.abstractmethod
    def lane_key(self, spec: RunSpec) -> str:
        """Runs with the same key share one execution lane (one thread, strictly serial)."""

    @abc.abstractmethod
    def create(self, spec: RunSpec) -> TrainingEngine:
        """Build the run's engine (fresh adapter / fresh copy). Raises ValueError for bad
        configs (→ user error); a create that raises leaves shared state (another run's
        model) as it was. Called on the run's lane."""

    @abc.abstractmethod
    def release(self, spec: RunSpec, engine: TrainingEngine) -> None:
        """Free the engine (delete the adapter / drop the copy). Called on the run's lane."""

    def close(self) -> None:
        """Free everything (service shutdown)."""


class LocalEngineFactory(EngineFactory):
    """In-process TorchEngines; LoRA adapters share one base model per directory."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self._shared: dict[Path, object] = {}  # directory -> PreTrainedModel | PeftModel

    def lane_key(self, spec: RunSpec) -> str:
        return f"lora:{spec.base.directory}" if spec.is_lora else f"full:{spec.run_id}"

    def create(self, spec: RunSpec) -> TrainingEngine:
        from ember.engine.registry import engine_class
        from ember.models import add_lora_adapter, load_model

        engine_cls = engine_class(self.config.backend)
        if not spec.is_lora:
            return engine_cls.from_pretrained(spec.base.directory, self.config, None, model_name=spec.base.name,
                                              optimizer_config={"type": spec.optimizer}, head=spec.head)
        base = self._shared.get(spec.base.directory)
        if base is None:
            c = self.config
            base = load_model(spec.base.directory, c.dtype, c.device, c.attn_implementation)
        name = adapter_name(spec.run_id)
        model = add_lora_adapter(base, name, spec.lora_config, unembed=spec.head == "policy")
        self._shared[spec.base.directory] = model
        try:
            return engine_cls(
                model, self.config, model_name=spec.base.name, lora_config=spec.lora_config, adapter_name=name,
                optimizer_config={"type": spec.optimizer}, head=spec.head,
            )
        except BaseException:
            # A failed creation leaves the shared model as it found it: the other tenants'
            # adapters only, and release() still knows when the last one is gone.
            self.release(spec, None)
            raise

    def release(self, spec: RunSpec, engine: TrainingEngine | None) -> None:
        if not spec.is_lora:
            return
        model = self._shared.get(spec.base.directory)
        name = adapter_name(spec.run_id)
        if model is None or name not in getattr(model, "peft_config", {}):
            return
        if len(model.peft_config) == 1:
            # Last tenant gone: drop the whole model rather than leave peft without an adapter.
            del self._shared[spec.base.directory]
            return
        from ember.models import remove_lora_adapter

        remove_lora_adapter(model, name)

    def close(self) -> None:
        self._shared.clear()

    def debug_state(self) -> dict[str, dict[Path, object]]:
        """The one inspection point of the factory (read-only): `shared_models`, LoRA base
        directory -> its shared (peft-wrapped) model, one per base in use (a new dict)."""
        return {"shared_models": dict(self._shared)}


class WorkerGroupEngineFactory(EngineFactory):
    """Engines on an `ember.workers.WorkerGroup` (inline | process | ray runtimes).

    Every run — LoRA or full — is one `GroupEngine` built on all ranks of the group with
    `parallelism` (None = FSDP2 over every rank). The group executes one call at a time,
    so all its runs share one lane. LoRA runs do not share base weights in this mode
    (each builds its own model on the ranks); use `LocalEngineFactory` for many small
    adapters on one base, this factory for models that need several devices.
    """

    def __init__(self, group, config: EngineConfig | None = None, parallelism=None, *,
                 owns_group: bool = False) -> None:
        self.group = group
        self.config = config or EngineConfig()
        self.parallelism = parallelism
        self.owns_group = owns_group  # True: close() shuts the group down (see `engine_factory_for`)

    def lane_key(self, spec: RunSpec) -> str:
        return f"group:{id(self.group)}"

    def create(self, spec: RunSpec) -> TrainingEngine:
        from ember.workers.engine import EngineSpec, GroupEngine

        engine_spec = EngineSpec(str(spec.base.directory), self.config, self.parallelism, spec.lora_config, spec.base.name,
                                 spec.optimizer, head=spec.head)
        return GroupEngine.create(self.group, adapter_name(spec.run_id), engine_spec)

    def release(self, spec: RunSpec, engine: TrainingEngine) -> None:
        engine.close()

    def close(self) -> None:
        if self.owns_group:
            self.group.shutdown()


def engine_factory_for(workers, config: EngineConfig | None = None) -> EngineFactory:
    """The engine factory a `WorkersConfig` asks for.

    runtime "local" → `LocalEngineFactory(config)`. Otherwise a new `WorkerGroup` of
    `workers.world_size` ranks (on CUDA when `config.device` is) and a
    `WorkerGroupEngineFactory` that owns it: `Service.close()` → `factory.close()` shuts
    the ranks down. Raises ValueError for layouts the group cannot run and
    `ember.workers.WorkerError` when the ranks fail to start.
    """
    config = config or EngineConfig()
    if workers.runtime == "local":
        return LocalEngineFactory(config)
    from ember.engine.parallel import ParallelismConfig
    from ember.workers import WorkerGroup

    parallelism = ParallelismConfig(**workers.parallel_dims())
    device = "cuda" if config.device.startswith("cuda") else "cpu"
    kwargs = {"address": workers.ray_address} if workers.runtime == "ray" else {}
    group = WorkerGroup.create(workers.runtime, workers.world_size, device=device,
                               call_timeout_s=workers.call_timeout_s, **kwargs)
    return WorkerGroupEngineFactory(group, config, parallelism, owns_group=True)
