"""Worker groups: N ranks over a runtime (inline | process | ray), dispatch, colocation.

    from ember.workers import WorkerGroup, EngineSpec, GroupEngine
    group = WorkerGroup.create("process", world_size=2)            # gloo on CPU, NCCL on GPU
    engine = GroupEngine.create(group, "policy", EngineSpec(model_dir))   # FSDP2 over 2 ranks
    engine.forward_backward(datums, "cross_entropy")
    group.shutdown()

`GroupEngine`/`EngineSpec` import the engine stack; they are loaded on first use.
"""

from ember.workers.dispatch import DISPATCHES, AllDispatch, Dispatch, MeshDispatch, RankLayout, balance, reduce_metrics
from ember.workers.group import RUNTIMES, WorkerGroup, make_runtime
from ember.workers.runtime import (
    RankContext,
    Runtime,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)


def __getattr__(name: str):
    if name in ("GroupEngine", "EngineSpec"):
        from ember.workers import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'ember.workers' has no attribute {name!r}")


__all__ = [
    "DISPATCHES",
    "RUNTIMES",
    "AllDispatch",
    "Dispatch",
    "EngineSpec",
    "GroupEngine",
    "MeshDispatch",
    "RankContext",
    "RankLayout",
    "Runtime",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroup",
    "WorkerTimeoutError",
    "balance",
    "make_runtime",
    "reduce_metrics",
]
