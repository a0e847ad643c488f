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
    sample(request, version_key,  a Future of `types.SampleResponse`; `request.version`
           follow=None)           and `request.follow` are None on the wire, `version_key`
                                  names the version (None = base weights), `follow` (a
                                  `FollowTag`) names the run follower it follows
    follow(follow_id, generation,  a publish of the pool's follower `follow_id`: the
           key)                   replica's mirror of it adopts version `key` as
                                  `generation` (answered on the reading thread, so a
                                  weight load never delays it)
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
from ember.sampling.follow import VersionFollower

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
    follows_mid_sequence: bool = False  # the backend's `Sampler.follows_mid_sequence`: the pool's answer


@dataclass(frozen=True)
class FollowTag:
    """What a followed sample carries to its replica instead of its `VersionFollower`
    (a lock and listeners: it cannot be pickled). `follow_id` names the follower (assigned
    by the pool, one per follower object); `adopt` holds the (generation, version key)
    pairs the replica's mirror of it adopts before the sample: the request's own version,
    then the follower's current one when newer (a replacement replica never heard the
    earlier forwards). Key None: the base weights."""

    follow_id: int
    adopt: tuple[tuple[int, int | None], ...]


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
    """The replica's side: one backend `Sampler`, its versions by the pool's keys, and one
    mirror `VersionFollower` per pool follower its followed samples read (`follow`)."""

    def __init__(self, model_dir: str, config: SamplerConfig, scratch_dir: str | None = None) -> None:
        from ember.sampling.registry import create_sampler

        self.config = config
        self.sampler: Sampler = create_sampler(model_dir, config, scratch_dir=scratch_dir)
        self._versions: dict[int, Any] = {}
        self._mirrors: dict[int, VersionFollower] = {}  # the pool's follow id -> its mirror here
        self._lock = threading.Lock()

    def info(self) -> ReplicaInfo:
        return ReplicaInfo(self.sampler.vocab_size, self.sampler.default_max_tokens, self.config.backend,
                           self.config.resolved_device, os.getpid(), tuple(self.sampler.eos_token_ids),
                           self.sampler.max_len, bool(self.sampler.follows_mid_sequence))

    def sample(self, request, version_key: int | None, follow: FollowTag | None = None) -> Future:
        with self._lock:
            version = self._versions.get(version_key) if version_key is not None else None
            if version_key is not None and version is None:
                raise ReplicaError(f"weight version {version_key} is not loaded on this replica")
            mirror = None
            for generation, key in follow.adopt if follow is not None else ():
                mirror = self._adopt(follow.follow_id, generation, key) or mirror
        return self.sampler.submit(dataclasses.replace(request, version=version, follow=mirror))

    def follow(self, follow_id: int, generation: int, key: int | None) -> None:
        """The pool's follower `follow_id` published version `key` as `generation`: the
        followed sequences running here switch to it at their next decode step."""
        with self._lock:
            self._adopt(follow_id, generation, key)

    def _adopt(self, follow_id: int, generation: int, key: int | None) -> VersionFollower | None:
        """Mirror `follow_id` adopts (key's version, generation), made on first use; a key
        not loaded here (dropped meanwhile) changes nothing. Called under the lock."""
        if key is not None and key not in self._versions:
            return self._mirrors.get(follow_id)
        version = self._versions.get(key) if key is not None else None
        mirror = self._mirrors.get(follow_id)
        if mirror is None:
            mirror = self._mirrors[follow_id] = VersionFollower(version, generation)
        else:
            mirror.adopt(version, generation)
        return mirror

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
        """Forget versions, and the mirrors whose current version is one of them (a mirror
        keeps no dropped version alive; the next forward or followed sample makes it anew)."""
        with self._lock:
            dropped = {id(self._versions.pop(key)) for key in keys if key in self._versions}
            for follow_id, mirror in list(self._mirrors.items()):
                if id(mirror.current()[1]) in dropped:
                    del self._mirrors[follow_id]

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
