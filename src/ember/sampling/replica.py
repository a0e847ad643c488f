"""Sampler replicas: the small interface between a `SamplerPool` and one copy of a backend.

A pool (`ember.sampling.pool`) serves one base model from `SamplerConfig.replicas`
copies of a backend sampler. Each copy lives behind a `Replica` (the pool's side: a
process on this machine, a Ray actor, ...) and runs a `ReplicaHost` (the replica's side:
the backend `Sampler` plus its weight versions by key). The pool talks to a replica only
through `Replica.call(op, *args)`, which runs `ReplicaHost.<op>(*args)` there:

    ============================  =====================================================
    op                            replica side (`ReplicaHost`)
    ============================  =====================================================
    info()                        `ReplicaInfo` once the backend is loaded (the pool's
                                  first call; it sends nothing else before the answer)
    sample(request, version_key)  a Future of `types.SampleResponse`; `request.version`
                                  is None on the wire, `version_key` names the version
                                  (None = base weights)
    load_file(key, path, lora)    make version `key` from a safetensors file
                                  (`FileTransport`: `SamplerConfig.weight_sync` "files")
    load_tensors(key, named, lora)  make version `key` from (name, tensor) pairs
                                  already in the replica's process (docs/architecture.md
                                  contract 4 holds: a key is immutable and loaded once)
    join_weight_sync(address)     join the pool's in-memory weight channel
                                  (`MemoryTransport`: weight_sync "memory")
    receive_weights()             receive one version over that channel and load it
                                  under the key its header names; returns the key
    drop(keys)                    forget versions (their memory is freed)
    sleep()                       colocation (`SamplerConfig.colocate`): the backend
                                  releases its memory to the trainer once its requests
                                  in progress are done; the next request wakes it
    sleep_stats()                 the backend's `sleep_stats` (asleep, sleeps, wakes),
                                  None for a backend without a sleep mode
    ping()                        answered at once, also while the backend computes
    close()                       stop the backend; pending samples fail
    ============================  =====================================================

Errors a caller sees from a `call` Future: `ValueError` when the request itself was
bad (the pool passes it on: category `user`), `ReplicaError` when the op raised anything
else there, and `ReplicaFailed` when the replica died or stopped answering (both
RuntimeErrors: category `server`, as every sampler failure that is not the request's).

A new placement is one class implementing `Replica` (its `start` returns at once; the
backend loads in the background) plus one line in `REPLICA_PLACEMENTS`. The replica side
is always `ReplicaHost`, whatever carries the calls.
"""

from __future__ import annotations

import abc
import dataclasses
import os
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from ember.sampling.base import Sampler
from ember.sampling.config import SamplerConfig

# Placement name (`SamplerConfig.placement`) -> "module:Class" of its `Replica`, imported on use.
REPLICA_PLACEMENTS: dict[str, str] = {
    "local": "ember.sampling.local_replica:LocalReplica",
    "ray": "ember.sampling.ray_replica:RayReplica",
}


class ReplicaError(RuntimeError):
    """An op raised on the replica (not the request's fault): category `server`."""


class ReplicaFailed(RuntimeError):
    """The replica died or stopped answering; the request may be retried (category `server`)."""


@dataclass(frozen=True)
class ReplicaInfo:
    """What a started replica reports: what the pool needs to answer `Sampler` questions."""

    vocab_size: int
    default_max_tokens: int
    backend: str
    device: str
    pid: int
    eos_token_ids: tuple[int, ...] = ()
    max_len: int | None = None


class Replica(abc.ABC):
    """The pool's handle on one replica. Thread-safe: `call` may be used from any thread."""

    index: int  # the replica's slot in the pool (0..replicas-1); a replacement takes the same slot

    @classmethod
    @abc.abstractmethod
    def start(cls, index: int, model_dir: str, config: SamplerConfig, scratch_dir: str | None) -> "Replica":
        """Start replica `index` serving `model_dir` with `config` (already `host_config`'d:
        replicas=1, its own device). Returns at once; `call("info")` answers when it is up."""

    @abc.abstractmethod
    def call(self, op: str, *args: Any) -> Future:
        """Run `ReplicaHost.<op>(*args)` on the replica; the Future resolves to its result
        (for `sample`, the response), or fails as the module docstring says. Never blocks."""

    @abc.abstractmethod
    def alive(self) -> bool:
        """False once the replica is known dead (its process/actor gone or killed)."""

    @property
    def pid(self) -> int | None:
        """The replica's process id on this machine; None where it is not a local process."""
        return None

    @abc.abstractmethod
    def kill(self) -> None:
        """Stop it now; every pending `call` Future fails with `ReplicaFailed`. Idempotent."""

    def close(self, timeout: float = 10.0) -> None:
        """Stop it gracefully: ask the host to close, wait up to `timeout`, then `kill`."""
        try:
            self.call("close").result(timeout)
        except Exception:  # noqa: BLE001 - closing a broken replica is killing it
            pass
        self.kill()


def host_config(config: SamplerConfig, index: int) -> SamplerConfig:
    """The backend config replica `index` runs with: one replica, its device from
    `config.devices` (round robin when fewer devices than replicas)."""
    device = config.devices[index % len(config.devices)] if config.devices else config.device
    return dataclasses.replace(config, replicas=1, devices=None, device=device)


def write_weight_file(named_weights: Iterable[tuple[str, torch.Tensor]], path: str) -> None:
    """Save (name, tensor) pairs as safetensors (aliased tensors, as tied embeddings, copied)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in named_weights:
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    tmp = f"{path}.tmp"
    save_file(tensors, tmp)
    os.replace(tmp, path)  # a replica never reads half a file


class ReplicaHost:
    """The replica's side: one backend `Sampler` and its versions by the pool's keys."""

    def __init__(self, model_dir: str, config: SamplerConfig, scratch_dir: str | None = None) -> None:
        from ember.sampling.registry import create_sampler

        self.config = config
        self.sampler: Sampler = create_sampler(model_dir, config, scratch_dir=scratch_dir)
        self._versions: dict[int, Any] = {}
        self._lock = threading.Lock()

    def info(self) -> ReplicaInfo:
        return ReplicaInfo(self.sampler.vocab_size, self.sampler.default_max_tokens, self.config.backend,
                           self.config.resolved_device, os.getpid(), tuple(self.sampler.eos_token_ids),
                           self.sampler.max_len)

    def sample(self, request, version_key: int | None) -> Future:
        if version_key is not None:
            with self._lock:
                version = self._versions.get(version_key)
            if version is None:
                raise ReplicaError(f"weight version {version_key} is not loaded on this replica")
            request = dataclasses.replace(request, version=version)
        return self.sampler.submit(request)

    def load_file(self, key: int, path: str, lora_config=None) -> None:
        from safetensors.torch import load_file

        self.load_tensors(key, load_file(path).items(), lora_config, copy=False)  # fresh tensors: keep them

    def load_tensors(self, key: int, named_weights: Iterable[tuple[str, torch.Tensor]], lora_config=None, *,
                     copy: bool = True) -> None:
        """The in-memory seam: make version `key` from tensors already in this process
        (`copy=False`: the caller hands them over and never writes to them again)."""
        with self._lock:
            if key in self._versions:  # loaded once: a key names one immutable version
                return
        version = self.sampler.load_weights(named_weights, lora_config, copy=copy)
        with self._lock:
            self._versions[key] = version

    def join_weight_sync(self, address) -> None:
        from ember.sampling.transport import WeightReceiver

        self._receiver = WeightReceiver(address, self.config.resolved_device)  # NCCL: this replica's GPU

    def receive_weights(self) -> int:
        """One version from the pool's channel, checked against the model before any data
        moves (a mismatch is refused naming the tensor; nothing is loaded)."""
        version_id, version = self._receiver.receive_into(self.sampler)
        with self._lock:  # the pool pushes a key to a replica once (contract 4: loaded once)
            self._versions.setdefault(int(version_id), version)
        return int(version_id)

    def drop(self, keys: Iterable[int]) -> None:
        with self._lock:
            for key in keys:
                self._versions.pop(key, None)

    def loaded(self) -> list[int]:
        with self._lock:
            return sorted(self._versions)

    def sleep(self) -> None:
        self.sampler.sleep()  # backends without a sleep mode ignore it

    def sleep_stats(self) -> dict | None:
        return self.sampler.sleep_stats

    def ping(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self.sampler.close()


def replica_class(placement: str) -> type[Replica]:
    from ember.registry import lookup

    try:
        return lookup(REPLICA_PLACEMENTS, placement, "sampler placement")
    except ImportError as exc:
        raise ValueError(f"sampler placement {placement!r} is not available here ({exc})") from exc
