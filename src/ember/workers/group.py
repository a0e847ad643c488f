"""`WorkerGroup`: N ranks over a runtime, holding named objects, dispatching calls to them.

    group = WorkerGroup.create("process", world_size=2)          # or "inline", "ray"
    group.build("policy", EngineSpec(model_dir, parallelism=ParallelismConfig(dp_shard=2)))
    out = group.call("policy", "forward_backward", datums, "cross_entropy", dispatch="mesh")
    group.call("policy", "optim_step", types.AdamParams(learning_rate=1e-4))   # dispatch="all"
    group.shutdown()

Colocation (`colocate=True`): several objects (engines, samplers) share the ranks'
devices; before a call reaches object X, the group offloads the object that was active
(`offload()` on every rank: parameters, gradients, optimizer state to CPU) and onloads X.
Building a new object offloads the active one first, so only one object's state is on the
device at a time. `memory()` reports each rank's accounting (see `ember.workers.worker`).

Faults: a dead or hung rank raises `WorkerDiedError`/`WorkerTimeoutError` from the call
and marks the group broken; every later call raises `WorkerError`. Recovery is explicit:
`shutdown()`, create a new group, rebuild the objects, `load_state` the last checkpoint,
and resubmit the calls made after it (the failed one included).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ember.workers.dispatch import Dispatch, RankLayout, get_dispatch
from ember.workers.runtime import Reply, Request, Runtime, WorkerError, raise_failure


# Worker runtimes by name: "module:Class", imported on first use (ray only when asked for).
# Adding a runtime = one file + one line here.
RUNTIMES: dict[str, str] = {
    "inline": "ember.workers.inline:InlineRuntime",
    "process": "ember.workers.process:ProcessRuntime",
    "ray": "ember.workers.ray_runtime:RayRuntime",
}


def make_runtime(runtime: str, world_size: int, device: str = "cpu", **kwargs) -> Runtime:
    """Instantiate a runtime by name (a key of RUNTIMES)."""
    from ember.registry import lookup

    return lookup(RUNTIMES, runtime, "runtime")(world_size, device, **kwargs)


@dataclass
class _Entry:
    layout: RankLayout


class WorkerGroup:
    def __init__(self, runtime: Runtime, *, colocate: bool = False, call_timeout_s: float = 600.0) -> None:
        self.runtime = runtime
        self.colocate = colocate
        self.call_timeout_s = call_timeout_s
        self._objects: dict[str, _Entry] = {}
        self._active: str | None = None
        self._broken: str | None = None
        self._lock = threading.RLock()
        runtime.start()

    @classmethod
    def create(
        cls, runtime: str = "inline", world_size: int = 1, *, device: str = "cpu", colocate: bool = False,
        call_timeout_s: float = 600.0, **runtime_kwargs,
    ) -> "WorkerGroup":
        return cls(make_runtime(runtime, world_size, device, **runtime_kwargs),
                   colocate=colocate, call_timeout_s=call_timeout_s)

    # ------------------------------------------------------------------ properties
    @property
    def world_size(self) -> int:
        return self.runtime.world_size

    @property
    def broken(self) -> str | None:
        return self._broken

    @property
    def names(self) -> list[str]:
        return list(self._objects)

    def layout(self, name: str) -> RankLayout:
        return self._entry(name).layout

    def _entry(self, name: str) -> _Entry:
        if name not in self._objects:
            raise KeyError(f"this worker group holds no object named {name!r}; built: {sorted(self._objects)}")
        return self._objects[name]

    # ------------------------------------------------------------------ low level
    def _execute(self, requests: list[Request], timeout_s: float | None) -> list[Reply]:
        if self._broken:
            raise WorkerError(f"this worker group is broken ({self._broken}); shut it down and build a new one")
        try:
            replies = self.runtime.execute(requests, timeout_s or self.call_timeout_s)
        except WorkerError as exc:
            self._broken = str(exc)
            raise
        self._broken = self.runtime.broken
        return replies

    def _broadcast(self, request: Request, timeout_s: float | None = None) -> list[Any]:
        replies = self._execute([request] * self.world_size, timeout_s)
        return _values(replies)

    # ------------------------------------------------------------------ objects
    def build(self, name: str, factory: Any, *, dp_size: int | None = None, timeout_s: float | None = None) -> None:
        """Build `factory(ctx)` on every rank as object `name`.

        `dp_size` (data-parallel degree for `mesh` dispatch) defaults to
        `factory.dp_size(world_size)` when the factory defines it, else the world size.
        """
        with self._lock:
            if name in self._objects:
                raise ValueError(f"an object named {name!r} already exists in this group")
            if dp_size is None:
                dp_size = factory.dp_size(self.world_size) if hasattr(factory, "dp_size") else self.world_size
            layout = RankLayout(self.world_size, dp_size)
            if self.colocate and self._active is not None:
                self._switch(None)
            try:
                self._broadcast(Request(op="build", target=name, fn=factory), timeout_s)
            except WorkerError:
                raise
            except Exception:  # e.g. a bad config: drop what the other ranks built
                self._broadcast(Request(op="remove", target=name))
                raise
            self._objects[name] = _Entry(layout)
            self._active = name

    def remove(self, name: str) -> None:
        """Drop an object on every rank (on a broken group, only forget it)."""
        with self._lock:
            self._entry(name)
            if not self._broken:
                self._broadcast(Request(op="remove", target=name))
            del self._objects[name]
            if self._active == name:
                self._active = None

    def _switch(self, name: str | None) -> None:
        """Colocation: offload the active object, onload `name` (None: just offload)."""
        if self._active == name:
            return
        if self._active is not None:
            self._broadcast(Request(op="call", target=self._active, method="offload"))
        self._active = None
        if name is not None:
            self._broadcast(Request(op="call", target=name, method="onload"))
            self._active = name

    # ------------------------------------------------------------------ calls
    def call(self, name: str, method: str, *args, dispatch: str | Dispatch = "all",
             timeout_s: float | None = None, **kwargs) -> Any:
        """`object.method(*args, **kwargs)` on the ranks, split and merged by `dispatch`."""
        return self._dispatch(Request(op="call", target=name, method=method), args, kwargs, dispatch, timeout_s)

    def run(self, name: str | None, fn: Any, *args, dispatch: str | Dispatch = "all",
            timeout_s: float | None = None, **kwargs) -> Any:
        """`fn(object, *args, **kwargs)` on the ranks (`fn(ctx, ...)` when `name` is None).

        `fn` must be importable (module-level) for the `process` and `ray` runtimes.
        """
        return self._dispatch(Request(op="run", target=name, fn=fn), args, kwargs, dispatch, timeout_s)

    def _dispatch(self, template: Request, args, kwargs, dispatch, timeout_s) -> Any:
        with self._lock:
            strategy = get_dispatch(dispatch)
            layout = self._entry(template.target).layout if template.target else RankLayout(self.world_size, self.world_size)
            if self.colocate and template.target is not None and template.method not in ("offload", "onload"):
                self._switch(template.target)
            per_rank, plan = strategy.scatter(tuple(args), dict(kwargs), layout)
            requests = [Request(op=template.op, target=template.target, method=template.method, fn=template.fn,
                                args=a, kwargs=k) for a, k in per_rank]
            results = _values(self._execute(requests, timeout_s))
            return strategy.gather(results, plan, layout)

    def run_per_rank(self, name: str | None, fn: Any, *args, timeout_s: float | None = None, **kwargs) -> list[Any]:
        """`fn` on every rank; every rank's answer, in rank order."""
        with self._lock:
            req = Request(op="run", target=name, fn=fn, args=tuple(args), kwargs=dict(kwargs))
            return self._broadcast(req, timeout_s)

    # ------------------------------------------------------------------ health, memory, lifecycle
    def ping(self, timeout_s: float = 30.0) -> list[int]:
        with self._lock:
            return self._broadcast(Request(op="ping"), timeout_s)

    def memory(self) -> list[dict[str, Any]]:
        """Per-rank memory accounting (tracked state bytes, peaks, RSS; CUDA peaks on GPU)."""
        with self._lock:
            return self._broadcast(Request(op="memory"))

    def pids(self) -> list[int]:
        pids = getattr(self.runtime, "pids", None)
        if callable(pids):
            return pids()
        import os

        return [os.getpid()]

    def shutdown(self) -> None:
        with self._lock:
            self.runtime.shutdown()
            self._objects.clear()
            self._active = None
            self._broken = self._broken or "shut down"

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _values(replies: list[Reply]) -> list[Any]:
    failures = [r for r in replies if not r.ok]
    if failures:
        # The root cause carries a remote traceback; ranks stopped because of it do not.
        raise_failure(next((r for r in failures if r.traceback), failures[0]))
    return [r.value for r in replies]
