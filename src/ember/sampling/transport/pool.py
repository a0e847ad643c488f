"""How a `SamplerPool`'s versions reach its replicas: one `WeightTransport`, chosen once
from `SamplerConfig.weight_sync` when the pool is built (`pool_transport`).

* `FileTransport` ("files"): the version is written once as a safetensors file under the
  pool's directory and each replica loads it (`ReplicaHost.load_file`); the file is what a
  replacement replica loads, deleted when the version is released.
* `MemoryTransport` ("memory"): nothing is written; the tensors are kept in this (the
  trainer's) process and pushed over a weight-sync channel per replica slot
  (`ReplicaSync`: `ReplicaHost.join_weight_sync` / `receive_weights`), to a replacement
  replica too.

The pool calls `keep` once per version, `load` to put it on some replicas (a replica that
fails is returned with the reason, and the pool replaces it; a ValueError is the
weights' own fault and raised), `attach` / `detach` as replicas start and leave, and
`forget` when the version's last handle is gone.
"""

from __future__ import annotations

import abc
import os
import threading
from collections.abc import Iterable, Mapping
from typing import ClassVar

import torch
from tinker import types

from ember.sampling.config import SamplerConfig
from ember.sampling.replica import Replica, host_config, write_weight_file
from ember.sampling.transport.channel import sync_backend
from ember.sampling.transport.endpoints import WeightSender, distinct_tensors

Named = Iterable[tuple[str, torch.Tensor]]


class WeightTransport(abc.ABC):
    """A pool's way of getting a version onto its replicas (see the module docstring).
    Thread-safe; `release` may run inside a garbage collection and takes no lock."""

    mode: ClassVar[str]  # its `SamplerConfig.weight_sync` value

    @abc.abstractmethod
    def keep(self, key: int, named_weights: Named, lora_config: types.LoraConfig | None, copy: bool = True) -> int:
        """Hold version `key` for the replicas (now and replacements later); its bytes here.
        `copy`: as `Sampler.load_weights` (False only when the caller never writes them again)."""

    @abc.abstractmethod
    def load(self, replicas: Mapping[int, Replica], key: int,
             timeout: float | None = None) -> tuple[list[int], dict[int, str]]:
        """Load version `key` on `replicas` (slot -> Replica): (slots that loaded it,
        {slot: why it failed}). A ValueError (the weights do not fit the model) is raised."""

    @abc.abstractmethod
    def holds(self, key: int) -> bool:
        """Whether version `key` is still kept (False once released or forgotten)."""

    @abc.abstractmethod
    def forget(self, keys: Iterable[int]) -> None:
        """Let go of versions (their last handle is gone; the replicas drop them too)."""

    def release(self, key: int) -> None:
        """Version `key`'s last handle died (any thread, possibly inside a GC: no locks)."""

    def attach(self, index: int, replica: Replica) -> None:
        """A replica started in slot `index` (before it loads anything)."""

    def detach(self, index: int) -> None:
        """The replica of slot `index` was taken out."""

    def close(self) -> None:
        """Release everything kept."""


class FileTransport(WeightTransport):
    """"files": each version a safetensors file under `directory` (the pool's own)."""

    mode = "files"

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._lora: dict[int, types.LoraConfig | None] = {}
        self._lock = threading.Lock()

    def path(self, key: int) -> str:
        return os.path.join(self.directory, f"v{key}.safetensors")

    def keep(self, key, named_weights, lora_config, copy=True) -> int:
        write_weight_file(named_weights, self.path(key))  # the file is the copy
        with self._lock:
            self._lora[key] = lora_config
        return os.path.getsize(self.path(key))

    def load(self, replicas, key, timeout=None):
        with self._lock:
            lora = self._lora[key]
        calls = {i: r.call("load_file", key, self.path(key), lora) for i, r in replicas.items()}
        loaded, failed = [], {}
        for i, fut in calls.items():
            try:
                fut.result(timeout)
            except ValueError:
                raise
            except Exception as exc:  # noqa: BLE001 - that replica's fault: the pool replaces it
                failed[i] = f"loading weights failed: {exc}"
                continue
            loaded.append(i)
        return loaded, failed

    def holds(self, key: int) -> bool:
        return os.path.exists(self.path(key))

    def release(self, key: int) -> None:
        try:  # at once, not at the monitor's next round: the disk is freed with the handle
            os.remove(self.path(key))
        except OSError:
            pass

    def forget(self, keys: Iterable[int]) -> None:
        for key in keys:
            with self._lock:
                self._lora.pop(key, None)
            self.release(key)


class MemoryTransport(WeightTransport):
    """"memory": the versions' tensors kept here and pushed over `ReplicaSync`'s channels."""

    mode = "memory"

    def __init__(self, sync: ReplicaSync) -> None:
        self.sync = sync

    def keep(self, key, named_weights, lora_config, copy=True) -> int:
        return self.sync.keep(key, named_weights, lora_config.rank if lora_config is not None else None, copy)

    def load(self, replicas, key, timeout=None):
        loaded, failed = self.sync.push(dict(replicas), key)
        return loaded, {i: f"weight sync failed: {why}" for i, why in failed.items()}

    def holds(self, key: int) -> bool:
        return self.sync.holds(key)

    def forget(self, keys: Iterable[int]) -> None:
        self.sync.forget(keys)

    def attach(self, index: int, replica) -> None:
        self.sync.attach(index, replica)

    def detach(self, index: int) -> None:
        self.sync.detach(index)

    def close(self) -> None:
        self.sync.close()


def pool_transport(config: SamplerConfig, directory: str) -> WeightTransport:
    """The transport `config.weight_sync` names, for a pool whose files live in `directory`.
    Memory: NCCL only between distinct local GPUs (a replica on the trainer's own GPU, or a
    Ray actor whose GPU may be the server's, receives through host memory over gloo)."""
    if config.weight_sync == FileTransport.mode:
        return FileTransport(directory)
    replicas = [host_config(config, i).device for i in range(config.replicas)] if config.placement == "local" else []
    backend = sync_backend(config.device, replicas)
    return MemoryTransport(ReplicaSync(sync_host(config.placement), config.replica_timeout_s, backend,
                                       device=config.device if backend == "nccl" else None))


class ReplicaSync:
    """The channels under `MemoryTransport`: one per replica slot, the live versions' tensors
    kept in this (the trainer's) process so that a replacement replica can be synced too.

    The pool calls `attach` when a replica starts, `push` to load a version on some of its
    replicas (each receives through the `ReplicaHost.receive_weights` op), `forget` when a
    version's last handle is gone, and `detach` when a replica is taken out. `push` returns
    within about `timeout_s` whatever the replicas do; the failed ones are returned so the
    pool takes them out (a sync never blocks training).
    """

    def __init__(self, host: str, timeout_s: float, backend: str = "gloo",
                 device: torch.device | str | None = None) -> None:
        self.sender = WeightSender(host, backend, timeout_s, device=device)
        self.timeout_s = timeout_s
        self._versions: dict[int, tuple[list[tuple[str, torch.Tensor]], int | None]] = {}
        self._lock = threading.Lock()
        self._pushing = threading.Lock()

    def keep(self, key: int, named_weights: Iterable[tuple[str, torch.Tensor]], lora_rank: int | None,
             copy: bool = True) -> int:
        """Hold version `key`'s tensors (each distinct one once); their bytes. `copy`: as
        `Sampler.load_weights` (False only when the caller never writes to them again)."""
        named = distinct_tensors((n, t.detach()) for n, t in named_weights)
        if copy:  # a version is immutable: the caller's live parameters must not show through
            named = [(n, t.clone()) for n, t in named]
        with self._lock:
            self._versions[key] = (named, lora_rank)
        return sum(t.numel() * t.element_size() for _, t in named)

    def debug_state(self) -> dict:
        """What this process keeps for replacement replicas, JSON-safe (for an operator's
        dump or a test): per version (by key, as a string), per tensor, its `data_ptr`
        (whether it is the caller's memory or a copy) and the `sum` of its values."""
        with self._lock:
            versions = {key: list(named) for key, (named, _) in self._versions.items()}
        return {"versions": {str(key): {name: {"data_ptr": t.data_ptr(), "sum": float(t.double().sum())}
                                        for name, t in named} for key, named in versions.items()}}

    def holds(self, key: int) -> bool:
        with self._lock:
            return key in self._versions

    def forget(self, keys: Iterable[int]) -> None:
        with self._lock:
            for key in keys:
                self._versions.pop(key, None)

    def attach(self, index: int, replica) -> None:
        """Open slot `index`'s channel and have its (new) replica join it."""
        self.detach(index)
        replica.call("join_weight_sync", self.sender.open(_rid(index)))  # a failed join fails the next push

    def detach(self, index: int) -> None:
        self.sender.drop(_rid(index))

    def push(self, replicas: dict[int, object], key: int) -> tuple[list[int], dict[int, str]]:
        """Send version `key` to `replicas` (slot index -> Replica); (slots that loaded it,
        {slot: why it failed}). A refusal raises `WeightSyncRefused` (the weights' fault)."""
        with self._lock:
            if key not in self._versions:  # released while a replica started: nobody needs it
                return [], {i: f"version {key} was released" for i in replicas}
            named, lora_rank = self._versions[key]
        with self._pushing:  # one push at a time: a replica's receives then meet the sends in order
            calls = {i: r.call("receive_weights") for i, r in replicas.items()}
            report = self.sender.send(named, str(key), lora_rank, only=[_rid(i) for i in replicas])
        failed = {int(rid.rsplit("-", 1)[1]): why for rid, why in report.dropped.items()}
        loaded = []
        for i, fut in calls.items():
            if i in failed:
                continue
            try:
                fut.result(self.timeout_s)
                loaded.append(i)
            except Exception as exc:  # noqa: BLE001 - that replica's fault: the pool replaces it
                failed[i] = f"{type(exc).__name__}: {exc}"
        return loaded, failed

    def close(self) -> None:
        self.sender.close()
        with self._lock:
            self._versions.clear()


def _rid(index: int) -> str:
    return f"replica-{index}"


def sync_host(placement: str) -> str:
    """The address replicas reach the trainer's channels on: loopback for local replicas,
    this node's IP on a Ray cluster (the replicas may be on other nodes)."""
    if placement == "ray":
        import ray

        return ray.util.get_node_ip_address()
    return "127.0.0.1"
