"""`RankWorker`: what runs on each rank, whatever the runtime.

A rank holds named objects built by factories (`factory(ctx) -> object`, e.g. an
`EngineSpec` building a TorchEngine) and executes requests against them:

* `build`  — `objects[name] = factory(ctx)`
* `call`   — `getattr(objects[name], method)(*args, **kwargs)`
* `run`    — `fn(objects[name], *args, **kwargs)` (or `fn(ctx, ...)` with no target)
* `remove` — drop an object (its memory is freed when the last reference goes)
* `ping`, `memory` — liveness and memory accounting

Iterator results (`named_weights`) are drained into lists on the rank: every rank must
run the same collectives in the same order, so every rank consumes the whole iterator.

Memory accounting for colocation: the rank tracks which objects are onloaded (an
`offload` call marks an object offloaded, `onload`/`build` onloaded) and records, after
each request, the peak over time of Σ state bytes of onloaded objects — parameters,
gradients and optimizer state, local shards only (`ember.workers.memory.state_bytes`).
On a GPU that is the device memory the objects' state occupies; on a CPU-only machine
offloading moves nothing, so this accounting is the quantity that shows what colocation
saves (and on GPU `torch.cuda.max_memory_allocated` is reported beside it).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ember.workers.memory import process_rss_bytes, state_bytes
from ember.workers.runtime import RankContext, Reply, Request


class RankWorker:
    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.objects: dict[str, Any] = {}
        self.onloaded: set[str] = set()
        self.peak_tracked_bytes = 0

    def handle(self, req: Request) -> Reply:
        try:
            value = self._execute(req)
        except BaseException as exc:  # noqa: BLE001 — every failure goes back to the caller
            return Reply.failure(self.ctx.rank, exc)
        finally:
            self._track()
        return Reply(rank=self.ctx.rank, ok=True, value=value)

    def _object(self, name: str | None) -> Any:
        if name not in self.objects:
            raise KeyError(f"rank {self.ctx.rank} holds no object named {name!r}; built: {sorted(self.objects)}")
        return self.objects[name]

    def _execute(self, req: Request) -> Any:
        if req.op == "build":
            if req.target in self.objects:
                raise ValueError(f"an object named {req.target!r} already exists on rank {self.ctx.rank}")
            self.objects[req.target] = req.fn(self.ctx)
            self.onloaded.add(req.target)
            return None
        if req.op == "call":
            result = getattr(self._object(req.target), req.method)(*req.args, **req.kwargs)
            self._note_residency(req.target, req.method)
            return _drain(result)
        if req.op == "run":
            first = self.ctx if req.target is None else self._object(req.target)
            return _drain(req.fn(first, *req.args, **req.kwargs))
        if req.op == "remove":
            self.objects.pop(req.target, None)
            self.onloaded.discard(req.target)
            return None
        if req.op == "ping":
            return self.ctx.rank
        if req.op == "memory":
            return self.memory_report()
        raise ValueError(f"unknown request op {req.op!r}")

    def _note_residency(self, name: str, method: str) -> None:
        if method == "offload":
            self.onloaded.discard(name)
        elif method == "onload":
            self.onloaded.add(name)

    def tracked_bytes(self) -> int:
        return sum(state_bytes(self.objects[n])["total"] for n in self.onloaded if n in self.objects)

    def _track(self) -> None:
        self.peak_tracked_bytes = max(self.peak_tracked_bytes, self.tracked_bytes())

    def memory_report(self) -> dict[str, Any]:
        report = {
            "rank": self.ctx.rank,
            "tracked_bytes": self.tracked_bytes(),
            "peak_tracked_bytes": self.peak_tracked_bytes,
            "objects": {n: state_bytes(o) for n, o in self.objects.items()},
            "onloaded": sorted(self.onloaded),
            "rss_bytes": process_rss_bytes(),
        }
        if self.ctx.device_type == "cuda":
            report["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        return report


def _drain(result: Any) -> Any:
    if isinstance(result, Iterator):
        return list(result)
    return result
