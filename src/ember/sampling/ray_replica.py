"""`placement="ray"`: each sampler replica a Ray actor on the cluster the server joined.

The replica side is `ReplicaHost` (ember.sampling.replica), as for every placement; this
module only carries the pool's calls to it:

* **Cluster**: the one this process is already connected to (a `ray` worker group's
  `ray.init`), else `use_cluster(address)`'s (`ember serve` passes `workers.ray_address`,
  the address the worker groups use), else Ray's own `RAY_ADDRESS`, else a local Ray
  instance started here (no dashboard).
* **Placement**: each replica reserves one bundle — `{"CPU": 1}` plus
  `{"GPU": tensor_parallel_size}` on CUDA — in a placement group of its own, so its
  resources are held together and released with it (`kill`). The pool spreads: a
  replica's group targets the alive node that fits the bundle and holds the fewest of
  this pool's replicas (a replacement therefore goes back to the node its predecessor
  left, or to another one if that node is gone). Per-replica groups, not one group of
  `replicas` bundles, because a replica starts knowing only its own slot, and a killed
  replica's group must go without disturbing the others'. On CUDA the actor sees only
  its GPUs (`CUDA_VISIBLE_DEVICES`), so its device is `cuda:0`.
* **Calls**: a threaded actor (`max_concurrency` = the backend's slots + 4), so `ping`
  answers while samples run; a `sample` blocks one actor thread until its response.
  Answers come back as ("ok", value) | ("user", UserError) | ("error", message), never
  as Ray exceptions, so a request's own fault keeps its type and message (category user).
* **Faults**: a call whose actor died (its process killed, its node lost) fails with
  `ReplicaFailed` as soon as Ray reports the death; `kill()` fails every pending call at
  once, without waiting for Ray (the pool kills a replica that stops answering pings
  within `SamplerConfig.replica_timeout_s`). Actors never restart on their own
  (`max_restarts=0`): the pool starts the replacement and syncs the live versions to it.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from ember.errors import UserError
from ember.sampling.config import SamplerConfig
from ember.sampling.replica import Replica, ReplicaError, ReplicaFailed

_cluster_address: str | None = None
# pool (model directory) -> {replica index: (node id it was placed on, the claim's token)}
_pool_nodes: dict[str, dict[int, tuple[str | None, object]]] = {}
_nodes_lock = threading.Lock()


def use_cluster(address: str | None) -> None:
    """Join this Ray cluster when the first Ray replica starts (None: Ray's defaults)."""
    global _cluster_address
    _cluster_address = address


def _ensure_ray():
    import ray

    with _nodes_lock:  # the pool starts its replicas from several threads at once
        if not ray.is_initialized():
            _init_ray(ray)
    return ray


def _init_ray(ray) -> None:
    address = _cluster_address or os.environ.get("RAY_ADDRESS") or None
    local = {"include_dashboard": False} if address is None else {}
    ray.init(address=address, log_to_driver=False, **local)


def replica_resources(config: SamplerConfig) -> dict[str, float]:
    """What one replica reserves: a CPU, plus its GPUs on CUDA (vLLM: tensor_parallel_size)."""
    bundle = {"CPU": 1.0}
    if config.resolved_device.startswith("cuda"):
        bundle["GPU"] = float(getattr(config, "tensor_parallel_size", None) or 1)
    return bundle


def _claim_node(ray, key: str, index: int, bundle: dict[str, float]) -> tuple[str | None, object]:
    """Pick the alive node that fits `bundle` and holds the fewest of this pool's replicas
    (ties: the most CPUs, then the node id) and record the claim at once, so replicas
    started together from several threads spread. Returns (node id, the claim's token)."""
    token = object()
    with _nodes_lock:
        nodes = _pool_nodes.setdefault(key, {})
        placed = [node for i, (node, _) in nodes.items() if i != index]
        candidates = []
        for node in ray.nodes():
            resources = node.get("Resources", {})
            if node.get("Alive") and all(resources.get(k, 0.0) >= v for k, v in bundle.items()):
                candidates.append((placed.count(node["NodeID"]), -resources.get("CPU", 0.0), node["NodeID"]))
        node_id = min(candidates)[2] if candidates else None
        nodes[index] = (node_id, token)
    return node_id, token


def _release_node(key: str, index: int, token: object) -> None:
    """Forget a claim; a replacement's newer claim on the same slot is kept."""
    with _nodes_lock:
        nodes = _pool_nodes.get(key, {})
        if nodes.get(index, (None, None))[1] is token:
            del nodes[index]


class _ReplicaActor:
    """The actor's body (wrapped with `ray.remote` on use): a `ReplicaHost`."""

    def __init__(self, model_dir: str, config: SamplerConfig, scratch_dir: str | None) -> None:
        from ember.sampling.replica import ReplicaHost

        self.host = ReplicaHost(model_dir, config, scratch_dir)

    def node(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), os.getpid()

    def call(self, op: str, args: tuple) -> tuple[str, Any]:
        try:
            value = getattr(self.host, op)(*args)
            if isinstance(value, Future):
                value = value.result()
            return "ok", value
        except UserError as exc:  # the request's own fault: its type and message travel
            return "user", exc
        except Exception as exc:  # noqa: BLE001 - anything else is the replica's
            return "error", f"{type(exc).__name__}: {exc}"


def _actor_died_errors() -> tuple[type, ...]:
    import ray.exceptions as rex

    names = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "WorkerCrashedError", "NodeDiedError")
    return tuple(getattr(rex, n) for n in names if hasattr(rex, n))


def actor_config(config: SamplerConfig) -> SamplerConfig:
    """The backend config inside the actor: Ray shows it only its own GPUs."""
    if config.resolved_device.startswith("cuda"):
        return dataclasses.replace(config, device="cuda:0")
    return config


class RayReplica(Replica):
    """The pool's handle on one replica actor (see the module docstring)."""

    def __init__(self, index: int, actor: Any, group: Any, claim: tuple[str, object]) -> None:
        self.index = index
        self._actor = actor
        self._group = group
        self._claim = claim  # (pool key, token) of its node claim
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._dead: str | None = None

    @classmethod
    def start(cls, index: int, model_dir: str, config: SamplerConfig, scratch_dir: str | None) -> "RayReplica":
        ray = _ensure_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle, key = replica_resources(config), os.path.realpath(model_dir)
        node_id, token = _claim_node(ray, key, index, bundle)
        group = placement_group([bundle], strategy="STRICT_PACK", _soft_target_node_id=node_id)
        actor_cls = ray.remote(max_restarts=0, max_task_retries=0)(_ReplicaActor)
        actor = actor_cls.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=0),
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_concurrency=config.max_slots + 4,
        ).remote(model_dir, actor_config(config), scratch_dir)
        return cls(index, actor, group, (key, token))

    def node(self, timeout: float = 60.0) -> tuple[str, int]:
        """(node IP, pid) of the actor (for operators and the two-host tests)."""
        import ray

        return ray.get(self._actor.node.remote(), timeout=timeout)

    def call(self, op: str, *args: Any) -> Future:
        out: Future = Future()
        with self._lock:
            if self._dead:
                out.set_exception(ReplicaFailed(f"sampler replica {self.index} is gone ({self._dead})"))
                return out
            call_id = next(self._ids)
            self._pending[call_id] = out
        # an iterator (e.g. `named_weights()`) cannot be pickled; its items can
        args = tuple(list(a) if isinstance(a, Iterator) else a for a in args)
        try:
            ref = self._actor.call.remote(op, args)
        except Exception as exc:  # noqa: BLE001 - e.g. an argument Ray cannot serialize
            self._settle(call_id, exc=ReplicaError(f"{op}: could not send to replica {self.index}: {exc}"))
            return out
        ref.future().add_done_callback(lambda f: self._answer(call_id, op, f))
        return out

    def _answer(self, call_id: int, op: str, done: Future) -> None:
        try:
            kind, value = done.result()
        except _actor_died_errors() as exc:
            self._mark_dead(f"actor died: {type(exc).__name__}")
            self._settle(call_id, exc=ReplicaFailed(f"sampler replica {self.index} died during {op}: "
                                                    f"{type(exc).__name__}"))
            return
        except Exception as exc:  # noqa: BLE001 - Ray could not run the call at all
            self._settle(call_id, exc=ReplicaError(f"{op} on replica {self.index}: {type(exc).__name__}: {exc}"))
            return
        if kind == "ok":
            self._settle(call_id, value=value)
        else:
            self._settle(call_id, exc=value if kind == "user" else ReplicaError(f"{op} on replica {self.index}: "
                                                                                f"{value}"))

    def _settle(self, call_id: int, value: Any = None, exc: BaseException | None = None) -> None:
        with self._lock:
            out = self._pending.pop(call_id, None)
        if out is None or out.done():  # already failed by kill()
            return
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(value)

    def _mark_dead(self, why: str) -> None:
        with self._lock:
            self._dead = self._dead or why

    def alive(self) -> bool:
        return self._dead is None

    def kill(self) -> None:
        self._mark_dead("killed")
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for out in pending:
            if not out.done():
                out.set_exception(ReplicaFailed(f"sampler replica {self.index} was stopped"))
        try:
            import ray
            from ray.util.placement_group import remove_placement_group

            ray.kill(self._actor, no_restart=True)
            remove_placement_group(self._group)
        except Exception:  # noqa: BLE001 - already dead, or the cluster is gone
            pass
        _release_node(self._claim[0], self.index, self._claim[1])
