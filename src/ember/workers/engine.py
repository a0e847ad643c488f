"""Training engines on a worker group: `EngineSpec` (the factory) and `GroupEngine`.

`GroupEngine` implements the `TrainingEngine` interface over a `WorkerGroup`, so the
service drives an SPMD engine on N ranks (local processes or Ray actors) exactly as it
drives an in-process `TorchEngine`:

    group = WorkerGroup.create("process", world_size=2)
    engine = GroupEngine.create(group, "run-1", EngineSpec(model_dir, EngineConfig(),
                                parallelism=ParallelismConfig(dp_shard=2)))
    engine.forward_backward(datums, "cross_entropy")   # mesh dispatch over data-parallel ranks
    engine.optim_step(types.AdamParams(learning_rate=1e-4))

Datums are validated in the caller before dispatch, so errors name the datum's index in
the caller's batch (not its index within one rank's share).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from tinker import types

from ember.engine.base import EngineInfo, EngineStatus, LossConfig, TrainingEngine
from ember.engine.config import EngineConfig
from ember.engine.parallel import ParallelismConfig
from ember.workers.group import WorkerGroup
from ember.workers.runtime import RankContext


@dataclass
class EngineSpec:
    """Builds one rank's TorchEngine: `spec(ctx)`. Picklable, so it travels to any runtime.

    parallelism: the layout; None means FSDP2 over every rank of the group
    (`ParallelismConfig(dp_shard=world_size)`). Its world size must equal the group's.
    config.device is replaced per rank (`cuda:<local rank>` on GPU runtimes).
    """

    model_dir: str
    config: EngineConfig = field(default_factory=EngineConfig)
    parallelism: ParallelismConfig | None = None
    lora_config: types.LoraConfig | None = None
    model_name: str | None = None
    optimizer: str = "adamw"  # `ember.engine.optimizers.OPTIMIZERS` key
    head: str = "policy"  # `ember.engine.heads.HEADS` key: "policy" | "value"

    def layout(self, world_size: int) -> ParallelismConfig:
        p = self.parallelism or ParallelismConfig.for_world(world_size)
        if p.world_size != world_size:
            raise ValueError(f"ParallelismConfig {p.as_dict()} needs {p.world_size} ranks; the group has {world_size}")
        return p

    def dp_size(self, world_size: int) -> int:
        return self.layout(world_size).dp_size

    def __call__(self, ctx: RankContext) -> TrainingEngine:
        from ember.engine.registry import engine_class

        config = replace(self.config, device=ctx.device)
        return engine_class(config.backend).from_pretrained(
            self.model_dir, config, lora_config=self.lora_config,
            model_name=self.model_name or str(self.model_dir), parallelism=self.layout(ctx.world_size),
            optimizer_config={"type": self.optimizer}, head=self.head,
        )


# ---------------------------------------------------------------------- functions run on ranks
def gather_named_weights(engine: Any, dtype: torch.dtype | None = None) -> list[tuple[str, torch.Tensor]]:
    """Every rank gathers each full tensor in turn (collectives); only rank 0 keeps them. A
    rank in a process of its own (a process group) returns them in host memory: a CUDA
    tensor would unpickle on the GPU in the caller (the server), making a CUDA context and
    a full copy there (`ember.forkserver`: the server touches no device)."""
    import torch.distributed as dist

    if not dist.is_initialized():  # inline: the caller's own process, tensors stay where they are
        return list(engine.named_weights(dtype))
    keep = dist.get_rank() == 0
    return [(n, to_host(t)) for n, t in engine.named_weights(dtype) if keep]


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` in host memory (itself when it is there already)."""
    return t if t.device.type == "cpu" else t.to("cpu")


def gather_head_weights(engine: Any) -> dict[str, torch.Tensor]:
    """The head's tensors (replicated on every rank); only rank 0 returns them."""
    import torch.distributed as dist

    keep = not dist.is_initialized() or dist.get_rank() == 0
    return engine.head_weights() if keep else {}


def vocab_size(engine: Any) -> int:
    return int(engine.hf_config.vocab_size)


# ---------------------------------------------------------------------- the engine
class GroupEngine(TrainingEngine):
    """A `TrainingEngine` whose ranks live in a `WorkerGroup` (object `name`)."""

    def __init__(self, group: WorkerGroup, name: str, head: str = "policy") -> None:
        from ember.engine.heads import head_output

        self.group = group
        self.name = name
        self._vocab: int | None = None
        self._output = head_output(head)  # what the ranks' head computes: validated here too

    @classmethod
    def create(cls, group: WorkerGroup, name: str, spec: EngineSpec) -> "GroupEngine":
        from ember.engine.heads import head_output

        head_output(spec.head)  # an unknown head is refused before any rank builds
        group.build(name, spec, dp_size=spec.dp_size(group.world_size))
        return cls(group, name, spec.head)

    def _call(self, method: str, *args, dispatch: str = "all", **kwargs) -> Any:
        return self.group.call(self.name, method, *args, dispatch=dispatch, **kwargs)

    def _validate(self, datums: Sequence[types.Datum], loss_fn: str, loss_fn_config: LossConfig | None) -> None:
        from ember.engine.batching import prepare_datums
        from ember.losses import get_loss, resolve_config

        if self._vocab is None:
            self._vocab = self.group.run(self.name, vocab_size)
        resolve_config(loss_fn, loss_fn_config)
        prepare_datums(datums, get_loss(loss_fn), self._vocab, output=self._output)

    def forward_backward(self, datums, loss_fn, loss_fn_config=None) -> types.ForwardBackwardOutput:
        self._validate(datums, loss_fn, loss_fn_config)
        return self._call("forward_backward", list(datums), loss_fn, loss_fn_config, dispatch="mesh")

    def forward(self, datums, loss_fn, loss_fn_config=None) -> types.ForwardBackwardOutput:
        self._validate(datums, loss_fn, loss_fn_config)
        return self._call("forward", list(datums), loss_fn, loss_fn_config, dispatch="mesh")

    def optim_step(self, adam_params: types.AdamParams) -> dict[str, float]:
        return self._call("optim_step", adam_params)

    def clear_gradients(self) -> None:
        self._call("clear_gradients")

    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.group.run(self.name, gather_named_weights, dtype))

    def head_weights(self) -> dict[str, torch.Tensor]:
        return self.group.run(self.name, gather_head_weights)

    def save_state(self, path: str | os.PathLike, optimizer: bool = True) -> None:
        self._call("save_state", str(path), optimizer)

    def load_state(self, path: str | os.PathLike, optimizer: bool = True) -> None:
        self._call("load_state", str(path), optimizer)

    def export_hf(self, path: str | os.PathLike) -> None:
        self._call("export_hf", str(path))

    def info(self) -> EngineInfo:
        return self._call("info")

    def status(self) -> EngineStatus:
        """Accumulated datums/tokens summed over data-parallel ranks."""
        per_rank = self.group.run_per_rank(self.name, _status)
        layout = self.group.layout(self.name)
        leaders = [per_rank[r] for r in layout.leaders()]
        return EngineStatus(
            step=leaders[0].step,
            accumulated_micro_batches=max(s.accumulated_micro_batches for s in leaders),
            accumulated_datums=sum(s.accumulated_datums for s in leaders),
            accumulated_tokens=sum(s.accumulated_tokens for s in leaders),
        )

    def offload(self) -> None:
        self._call("offload")

    def onload(self) -> None:
        self._call("onload")

    def close(self) -> None:
        """Drop this engine from its group (the group keeps running)."""
        self.group.remove(self.name)


def _status(engine: Any) -> EngineStatus:
    return engine.status()
