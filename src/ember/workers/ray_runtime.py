"""`ray` runtime: one Ray actor per rank, in a placement group, joined by torch.distributed.

* `address=None` starts (or reuses) a local Ray instance with `init_kwargs` (tests pass
  `{"num_cpus": 2, "include_dashboard": False}`); `address="ray://..."`/`"auto"` joins an
  existing cluster — Ray is the cluster manager, ember does not invent one.
* The placement group reserves `{"CPU": cpus_per_rank, "GPU": gpus_per_rank}` per rank
  (strategy `PACK` by default; `SPREAD`/`STRICT_SPREAD` for multi-node), so the ranks
  start together or not at all (bounded by `start_timeout_s`).
* Rendezvous: rank 0's actor reports its node IP and a free port; every rank joins
  `tcp://ip:port` (gloo on CPU, NCCL on GPU).
* Faults: `ray.wait` with the call's timeout. A dead actor (`kill -9` of its process, a
  lost node) resolves its pending call with `RayActorError` → `WorkerDiedError`, even while
  the other ranks are blocked in a collective; no reply in time → `WorkerTimeoutError`.
  Either way all actors are killed and the placement group removed.
Actors never restart on their own (`max_restarts=0`): a rank's state is its engine's, so
recovery is the caller's rebuild + `load_state` of its last checkpoint.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

from ember.workers.remote import RemoteRuntime, answer, dumps, pid_alive
from ember.workers.runtime import RankContext, Reply, Request, WorkerDiedError, WorkerError, free_port, init_rank_process


class _RankActor:
    """The body of each rank's Ray actor (wrapped with `ray.remote` lazily)."""

    def __init__(self) -> None:
        self.worker = None

    def rendezvous_address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, ctx: RankContext, addr: str, port: int, threads: int, pg_timeout_s: float) -> int:
        import os

        from ember.workers.worker import RankWorker

        init_rank_process(ctx, addr, port, threads, pg_timeout_s)
        self.worker = RankWorker(ctx)
        return os.getpid()

    def handle(self, data: bytes) -> bytes | None:
        return answer(self.worker, data)


def _dead_actor_errors():
    import ray.exceptions as rex

    return tuple(getattr(rex, n) for n in ("RayActorError", "ActorDiedError", "ActorUnavailableError") if hasattr(rex, n))


class RayRuntime(RemoteRuntime):
    name = "ray"

    def __init__(
        self,
        world_size: int = 1,
        device: str = "cpu",
        *,
        address: str | None = None,
        init_kwargs: dict[str, Any] | None = None,
        cpus_per_rank: float = 1.0,
        strategy: str = "PACK",
        **rank_options: Any,
    ) -> None:
        """rank_options: `RemoteRuntime`'s (torch_threads, start_timeout_s, pg_timeout_s, failure_grace_s)."""
        super().__init__(world_size, device, **rank_options)
        self.address = address
        self.init_kwargs = dict(init_kwargs or {})
        self.cpus_per_rank = cpus_per_rank
        self.strategy = strategy
        self._actors: list[Any] = []
        self._pg = None
        self._pids: list[int] = []

    # ------------------------------------------------------------------ lifecycle
    def _ensure_ray(self):
        import ray

        if not ray.is_initialized():
            # Cluster-shaping options only apply to a local instance, not to joining a cluster.
            defaults = {"include_dashboard": False} if self.address is None else {}
            ray.init(address=self.address, **{"log_to_driver": False, **defaults, **self.init_kwargs})
        return ray

    def _bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.cpus_per_rank}
        if self.device_type == "cuda":
            bundle["GPU"] = 1
        return bundle

    def start(self) -> None:
        ray = self._ensure_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._pg = placement_group([self._bundle()] * self.world_size, strategy=self.strategy)
        try:
            ray.get(self._pg.ready(), timeout=self.start_timeout_s)
        except Exception as exc:
            self.shutdown()
            raise WorkerError(f"Ray could not reserve {self.world_size} x {self._bundle()} in time: {exc}") from exc
        actor_cls = ray.remote(max_restarts=0, max_task_retries=0)(_RankActor)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self._pg, placement_group_bundle_index=rank)
            self._actors.append(
                actor_cls.options(
                    scheduling_strategy=strategy, num_cpus=self.cpus_per_rank,
                    num_gpus=1 if self.device_type == "cuda" else 0, name=None,
                ).remote()
            )
        self._setup_ranks(ray)

    def _setup_ranks(self, ray) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        try:
            addr, port = ray.get(self._actors[0].rendezvous_address.remote(), timeout=self.start_timeout_s)
            refs = [
                a.setup.remote(
                    # on one node each rank is its own local rank; Ray sets CUDA_VISIBLE_DEVICES per actor
                    RankContext(r, self.world_size, 0 if self.device_type == "cuda" else r,
                                self.device_type, self.backend),
                    addr, port, self.torch_threads, self.pg_timeout_s,
                )
                for r, a in enumerate(self._actors)
            ]
            self._pids = self._wait(refs, deadline, "start")
        except WorkerError:
            raise
        except Exception as exc:
            self.shutdown()
            raise WorkerError(f"Ray ranks failed to start: {exc}") from exc

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            self._actors, self._pg = [], None
            return
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._pg)
            except Exception:
                pass
        self._actors, self._pg = [], None

    def alive(self) -> list[bool]:
        return [pid_alive(pid) for pid in self._pids] if self._pids else [False] * self.world_size

    def pids(self) -> list[int]:
        return list(self._pids)

    # ------------------------------------------------------------------ calls
    def execute(self, requests: list[Request], timeout_s: float) -> list[Reply]:
        self._check_callable(started=bool(self._actors))
        payloads = [dumps(r) for r in requests]  # all or none
        refs = [a.handle.remote(p) for a, p in zip(self._actors, payloads)]
        what = f"call {requests[0].op}:{requests[0].method or ''}"
        return self._wait(refs, time.monotonic() + timeout_s, what, decode=pickle.loads)

    def _wait(self, refs: list, deadline: float, what: str, decode=None) -> list:
        import ray

        index = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return self._out_of_time(results, sorted(index[r] for r in pending), what)
            done, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            for ref in done:
                try:
                    value = ray.get(ref)
                except _dead_actor_errors() as exc:
                    self._fail(WorkerDiedError, f"{what}: rank {index[ref]} died ({type(exc).__name__}: {exc})")
                results[index[ref]] = decode(value) if decode else value
                deadline = self._deadline_after(results[index[ref]], deadline)
        return [results[r] for r in range(len(refs))]

    def _stop_ranks(self) -> None:
        self.shutdown()
