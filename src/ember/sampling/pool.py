"""`SamplerPool`: `SamplerConfig.replicas` copies of a backend behind one `Sampler`.

The service sees one `Sampler` per base model whatever the number of replicas
(`create_sampler` returns a pool only when `replicas > 1`; with 1 nothing here runs).
Each replica is a `Replica` (ember.sampling.replica: a process on this machine for
placement "local", a Ray actor for "ray") running a `ReplicaHost` over the backend
`SamplerConfig.backend` names, on its own device (`SamplerConfig.devices`).

Routing: every request of one sampling session (`SamplingRequest.session`; the service
passes the sampling session id, in-process callers get owner + version) goes to one
replica, chosen by `ember.sampling.router.SessionRouter` (consistent hashing, spill of
new sessions past `max_imbalance`; its module docstring states the policy).

Versions (docs/architecture.md contract 4): `load_weights` hands the version once to the
pool's `WeightTransport` (`ember.sampling.transport.pool`, chosen from
`SamplerConfig.weight_sync`: a safetensors file under the pool's scratch directory, or
the tensors kept here and pushed over weight-sync channels) and loads it on *every* up
replica before it returns (eager, not lazy: any replica can then serve any session's
version, which spilling and fail-over need, and no request ever waits for a load). What
the transport keeps is what a replacement replica loads the live versions from; it is
let go when the version's last handle is dropped (and the replicas forget it).

In-flight weights (docs/architecture.md, in-flight weights): when the replicas' backend
follows mid-sequence (`ReplicaInfo.follows_mid_sequence`), so does the pool. A followed
request travels with a `FollowTag` instead of its `VersionFollower`; the pool subscribes
once to each follower and forwards every publish to every up replica (`follow`), where a
mirror follower per tag is what the backend reads before each decode step. The
sequence's `version_spans` come back in the follower's generation numbers.

Faults: a replica whose process is gone, or that leaves a ping unanswered for
`replica_timeout_s`, is taken out of the ring at once; its in-flight requests fail with
`ReplicaFailed` (a RuntimeError: category `server`), other replicas' requests are
untouched, its sessions move to their next replica on the ring, and a replacement is
started in the background in the same slot, loads every live version, and rejoins. A
`load_weights` waiting on a replica that dies gets its answer from the others: a sync
never waits on a dead replica for longer than `replica_timeout_s`.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import itertools
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from tinker import types

from ember.sampling.base import Sampler, SamplingRequest, WeightVersion
from ember.sampling.config import SamplerConfig
from ember.sampling.replica import FollowTag, Replica, ReplicaFailed, ReplicaInfo, host_config, replica_class
from ember.sampling.router import NoReplicaError, SessionRouter
from ember.sampling.transport.pool import WeightTransport, pool_transport

log = logging.getLogger(__name__)
_pool_ids = itertools.count(1)
_RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
_NOT_OURS = object()  # a version another sampler loaded: no key here


class PoolWeightVersion(WeightVersion):
    """A version of a pool: loaded on every replica under `key`, kept by the pool's
    `WeightTransport` (what a replacement replica loads; let go with the last handle)."""

    def __init__(self, sampler_id: int, key: int, is_lora: bool, lora_rank: int | None, nbytes: int = 0) -> None:
        super().__init__(sampler_id, is_lora=is_lora, lora_rank=lora_rank)
        self.key = key
        self._nbytes = nbytes

    def nbytes(self) -> int:
        """What the pool keeps of it here: the file's size, or the kept tensors' bytes."""
        return self._nbytes


def _release(released: queue.SimpleQueue, transport: WeightTransport, key: int) -> None:
    """A version's last handle is gone (any thread, possibly inside a GC): the transport
    lets go of what it can at once, and the key is queued for the monitor, which tells the
    replicas (no locks taken here)."""
    transport.release(key)
    released.put(key)


class _Forward:
    """A follower's listener (`VersionFollower.subscribe`): each publish goes on to the
    pool's replicas. Holds the pool by weakref: a follower outliving the pool keeps nothing."""

    def __init__(self, pool: "SamplerPool", follow_id: int) -> None:
        self._pool, self.follow_id = weakref.ref(pool), follow_id

    def __call__(self, generation: int, version) -> None:
        pool = self._pool()
        if pool is not None:
            pool._forward(self.follow_id, generation, version)


def _log_failed_forward(index: int, done: Future) -> None:
    if done.exception() is not None:  # a dead replica is the monitor's business
        log.warning("sampler replica %d did not adopt an in-flight version: %s", index, done.exception())


@dataclass
class _Slot:
    """One replica position in the pool; a replacement takes over the slot."""

    index: int
    replica: Replica | None = None
    up: bool = False
    in_flight: int = 0
    requests_total: int = 0
    restarts: int = 0
    loaded: set[int] = field(default_factory=set)
    ping: Future | None = None
    ping_sent: float = 0.0


class SamplerPool(Sampler):
    """Replicas of one backend behind the `Sampler` interface (see the module docstring)."""

    def __init__(self, model_dir: str | os.PathLike, config: SamplerConfig,
                 scratch_dir: str | os.PathLike | None = None) -> None:
        self.config, self.model_dir = config, str(model_dir)
        self._id = next(_pool_ids)
        self._replica_cls = replica_class(config.placement)
        self._own_scratch = scratch_dir is None
        base = tempfile.mkdtemp(prefix="ember-pool-") if scratch_dir is None else str(scratch_dir)
        self._dir = os.path.join(base, f"pool-{os.getpid()}-{self._id}")
        os.makedirs(self._dir, exist_ok=True)
        self._scratch = base
        self._slots = [_Slot(i) for i in range(config.replicas)]
        self._router = SessionRouter([], config.max_imbalance)
        self._versions: set[int] = set()  # live version keys (the transport keeps their weights)
        self._keys = itertools.count(1)
        self._released: queue.SimpleQueue = queue.SimpleQueue()  # keys whose handle died (any thread)
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._closed = False
        self._starting: set[Replica] = set()
        self._info: ReplicaInfo | None = None
        self._follow_ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # VersionFollower -> id
        self._next_follow_id = itertools.count(1)
        self._transport = pool_transport(config, self._dir)
        self._load_tokenizer()
        self._start_all()
        self._monitor = threading.Thread(target=self._watch, name=f"ember-pool-{self._id}", daemon=True)
        self._monitor.start()
        atexit.register(_close_at_exit, weakref.ref(self))

    @classmethod
    def from_pretrained(cls, model_dir, config: SamplerConfig | None = None, scratch_dir=None) -> "SamplerPool":
        return cls(model_dir, config or SamplerConfig(replicas=2), scratch_dir)

    @classmethod
    def check_model(cls, model_dir, config) -> None:
        from ember.sampling.registry import sampler_class

        sampler_class(config.backend).check_model(model_dir, config)

    # ------------------------------------------------------------------ Sampler API
    @property
    def vocab_size(self) -> int:
        return self._info.vocab_size

    @property
    def max_len(self) -> int | None:
        return self._info.max_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._info.eos_token_ids

    @property
    def default_max_tokens(self) -> int:
        return self._info.default_max_tokens

    @property
    def follows_mid_sequence(self) -> bool:
        """What the replicas' backend reports (`ReplicaInfo`): the pool forwards publishes."""
        return self._info is not None and self._info.follows_mid_sequence

    def keeps(self, key: int) -> bool:
        """Whether the pool's transport still keeps the weights of the version with this
        `PoolWeightVersion.key` (its file, or its tensors in memory): False once the
        version's last handle is gone."""
        return self._transport.holds(key)

    def live_versions(self) -> int:
        """Versions of this pool still referenced somewhere."""
        self._drain_released()
        with self._lock:
            return len(self._versions)

    def load_weights(self, named_weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                     lora_config: types.LoraConfig | None = None, *, copy: bool = True) -> PoolWeightVersion:
        items = named_weights.items() if isinstance(named_weights, Mapping) else named_weights
        key = next(self._keys)
        nbytes = self._transport.keep(key, items, lora_config, copy)
        with self._lock:
            self._versions.add(key)
            targets = [s for s in self._slots if s.up]
        try:
            self._load_on(targets, key)
        except BaseException:
            self._forget([key])
            raise
        version = PoolWeightVersion(self._id, key, lora_config is not None,
                                    lora_config.rank if lora_config is not None else None, nbytes)
        weakref.finalize(version, _release, self._released, self._transport, key)
        return version

    def submit(self, request: SamplingRequest) -> Future:
        return self.submit_many([request])[0]

    def submit_many(self, requests: Sequence[SamplingRequest]) -> list[Future]:
        return [self._submit_one(r) for r in requests]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            slots = [s for s in self._slots if s.replica is not None]
            for s in slots:
                s.up = False
            starting = list(self._starting)
        self._wake.set()
        for replica in starting:
            replica.kill()
        for s in slots:
            s.replica.close(timeout=30)
        self._transport.close()
        shutil.rmtree(self._dir if not self._own_scratch else self._scratch, ignore_errors=True)

    def sleep(self) -> None:
        """Colocation (`SamplerConfig.colocate`; the service calls it before every training
        op): every up replica releases its memory to the trainer once its requests in
        progress are done, and wakes on its next request. Returns when all have slept; a
        replica that fails meanwhile is taken out (its replacement starts awake). A replica
        that hangs is taken out by the monitor (`replica_timeout_s`), which fails this call
        too: it never waits on a dead replica."""
        if not self.config.colocate:
            return
        with self._lock:
            calls = [(s, s.replica, s.replica.call("sleep")) for s in self._slots if s.up]
        for slot, replica, fut in calls:
            try:
                fut.result()
            except Exception as exc:  # noqa: BLE001 - that replica's fault: replace it
                self._take_out(slot, f"sleep failed: {exc}", replica)

    # ------------------------------------------------------------------ operators
    def debug_state(self, timeout: float = 60.0) -> dict[str, list]:
        """The one inspection point of the pool (read-only), per replica slot: `replicas`
        (`replica_stats`), `infos` (what each replica reports of itself: pid, backend, device)
        and `sleep` (what its backend reports of its sleep mode: `asleep`, `sleeps`, `wakes`
        since that replica started; None for a backend without one), each replica asked in
        turn within `timeout`."""
        with self._lock:
            replicas = [s.replica for s in self._slots]
        return {"replicas": self.replica_stats(), "infos": [r.call("info").result(timeout) for r in replicas],
                "sleep": [r.call("sleep_stats").result(timeout) for r in replicas]}

    def replica_stats(self) -> list[dict]:
        """Per replica slot: up, requests routed to it since start, in flight now, restarts."""
        with self._lock:
            return [{"replica": s.index, "up": s.up, "requests_total": s.requests_total,
                     "in_flight": s.in_flight, "restarts": s.restarts} for s in self._slots]

    def replica_pids(self) -> list[int | None]:
        with self._lock:
            return [s.replica.pid if s.up else None for s in self._slots]

    def use_router(self, router_cls) -> None:
        """Route with a fresh `router_cls(up replicas, max_imbalance)` from now on
        (`ember.sampling.router`: the benchmark compares SessionRouter with RoundRobinRouter)."""
        with self._lock:
            self._router = router_cls([s.index for s in self._slots if s.up], self.config.max_imbalance)

    def route_of(self, session: str) -> int | None:
        """The replica a session's requests go to now (None: not placed yet)."""
        with self._lock:
            return self._router.placement(session) if hasattr(self._router, "placement") else None

    # ------------------------------------------------------------------ requests
    def _submit_one(self, request: SamplingRequest) -> Future:
        out: Future = Future()
        try:
            key = self._version_key(request)
            tag = self._follow_tag(request, key)
            slot, replica = self._route(request)
        except ValueError as exc:
            out.set_exception(exc)
            return out
        except NoReplicaError as exc:
            out.set_exception(ReplicaFailed(f"{exc} (replacements are starting)"))
            return out
        inner = replica.call("sample", dataclasses.replace(request, version=None, follow=None), key, tag)
        inner.add_done_callback(lambda f: self._finished(slot, replica, f, out))
        return out

    def _version_key(self, request: SamplingRequest) -> int | None:
        if not isinstance(request, SamplingRequest):
            raise ValueError(f"submit: expected a SamplingRequest, got {type(request).__name__}")
        version = request.version
        if version is None:
            return None
        if not isinstance(version, PoolWeightVersion) or version.sampler_id != self._id:
            raise ValueError(f"sample request: version: {version!r} was not loaded into this sampler")
        return version.key

    def _follow_tag(self, request: SamplingRequest, key: int | None) -> FollowTag | None:
        """The tag a followed request carries to its replica (None: not followed, or the
        backend adopts per request only). ValueError: its version was never published to
        its follower."""
        follow = request.follow
        if follow is None or not self.follows_mid_sequence:
            return None
        follow_id = self._follow_id(follow)  # subscribed before `current`: no publish falls between
        adopt = [(follow.generation_of(request.version), key)]
        generation, current = follow.current()
        current_key = self._pool_key(current)
        if generation > adopt[0][0] and current_key is not _NOT_OURS:
            adopt.append((generation, current_key))
        return FollowTag(follow_id, tuple(adopt))

    def _follow_id(self, follow) -> int:
        """The pool's id of a follower, subscribing to it on first sight (under the lock, so
        no caller gets the id before the subscription; `subscribe` calls no listener)."""
        with self._lock:
            follow_id = self._follow_ids.get(follow)
            if follow_id is None:
                follow_id = self._follow_ids[follow] = next(self._next_follow_id)
                follow.subscribe(_Forward(self, follow_id))
            return follow_id

    def _pool_key(self, version) -> int | None | object:
        """A version's key here (None: the base weights; `_NOT_OURS`: another sampler's)."""
        if version is None:
            return None
        if isinstance(version, PoolWeightVersion) and version.sampler_id == self._id:
            return version.key
        return _NOT_OURS

    def _forward(self, follow_id: int, generation: int, version) -> None:
        """A follower published: every up replica's mirror adopts it (fire and forget, in
        the publisher's thread: `Replica.call` never blocks)."""
        key = self._pool_key(version)
        if key is _NOT_OURS:
            log.debug("follower %d published a version of another sampler; not forwarded", follow_id)
            return
        with self._lock:
            replicas = [s.replica for s in self._slots if s.up]
        for replica in replicas:
            replica.call("follow", follow_id, generation, key).add_done_callback(
                functools.partial(_log_failed_forward, replica.index))

    def _route(self, request: SamplingRequest) -> tuple[_Slot, Replica]:
        session = request.session or f"{request.owner}:{getattr(request.version, 'key', 0)}"
        with self._lock:
            if self._closed:
                raise NoReplicaError("the sampler is closed")
            depths = {s.index: s.in_flight for s in self._slots if s.up}
            slot = self._slots[self._router.route(session, depths)]
            slot.in_flight += 1
            slot.requests_total += 1
            return slot, slot.replica

    def _finished(self, slot: _Slot, replica: Replica, inner: Future, out: Future) -> None:
        with self._lock:
            slot.in_flight -= 1
        exc = inner.exception()
        if exc is None:
            out.set_result(inner.result())
            return
        if isinstance(exc, ReplicaFailed):  # out of the ring before the caller hears of it
            self._take_out(slot, str(exc), replica)
        out.set_exception(exc)

    # ------------------------------------------------------------------ versions
    def _load_on(self, slots: list[_Slot], key: int) -> None:
        """Load `key` on every slot; a replica failing is taken out (its replacement loads
        it), a ValueError (the weights themselves are bad) is the caller's."""
        replicas = {s.index: s.replica for s in slots}
        loaded, failed = self._transport.load(replicas, key)
        for s in slots:
            if s.index in failed:
                self._take_out(s, failed[s.index], replicas[s.index])
            elif s.index in loaded:
                with self._lock:
                    s.loaded.add(key)
        if slots and not loaded:
            raise ReplicaFailed("no sampler replica could load the weights (all failed; replacements are starting)")

    def _forget(self, keys: list[int]) -> None:
        with self._lock:
            self._versions.difference_update(keys)
            up = [s for s in self._slots if s.up]
            for s in self._slots:
                s.loaded.difference_update(keys)
        for s in up:
            s.replica.call("drop", keys)
        self._transport.forget(keys)

    def _drain_released(self) -> None:
        keys = []
        while True:
            try:
                keys.append(self._released.get_nowait())
            except queue.Empty:
                break
        if keys:
            self._forget(keys)

    # ------------------------------------------------------------------ replicas
    def _load_tokenizer(self) -> None:
        """The tokenizer, for callers that decode what they sampled (the replicas have their own)."""
        from ember.models import load_tokenizer

        try:
            self.tokenizer = load_tokenizer(self.model_dir)
        except (OSError, ValueError):
            self.tokenizer = None

    def _start_all(self) -> None:
        errors: list[BaseException] = []

        def up(slot: _Slot) -> None:
            try:
                self._bring_up(slot)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        threads = [threading.Thread(target=up, args=(s,)) for s in self._slots]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.close()
            raise errors[0]

    def _bring_up(self, slot: _Slot) -> None:
        """Start a replica in `slot`, load every live version, put it in the ring."""
        cfg = host_config(self.config, slot.index)
        # Its own scratch directory: backends name their files by ids that every replica repeats.
        scratch = tempfile.mkdtemp(prefix=f"replica-{slot.index}-", dir=self._dir)
        replica = self._replica_cls.start(slot.index, self.model_dir, cfg, scratch)
        with self._lock:
            self._starting.add(replica)  # close() stops it too
        try:
            info = replica.call("info").result(self.config.engine_start_timeout_s)
            slot.replica, slot.loaded = replica, set()
            self._transport.attach(slot.index, replica)
            while not self._join(slot, info):
                with self._lock:
                    missing = sorted(set(self._versions) - slot.loaded)
                self._load_missing(slot, missing)
        except BaseException:
            replica.kill()
            raise
        finally:
            with self._lock:
                self._starting.discard(replica)
        log.info("sampler replica %d up (pid %s, %s on %s)", slot.index, info.pid, info.backend, info.device)

    def _join(self, slot: _Slot, info: ReplicaInfo) -> bool:
        """Put `slot` in the ring if it has every live version (else False: load them first)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the sampler pool was closed while a replica started")
            if set(self._versions) - slot.loaded:
                return False
            self._info = self._info or info
            slot.up, slot.ping = True, None
            self._router.add(slot.index)
            return True

    def _load_missing(self, slot: _Slot, keys: list[int]) -> None:
        """Load live versions on a starting replica (a failure fails its start, unless the
        version was released meanwhile: then there is nothing to serve)."""
        for key in keys:
            with self._lock:
                if key not in self._versions:
                    continue  # released meanwhile
            loaded, failed = self._transport.load({slot.index: slot.replica}, key, self.config.engine_start_timeout_s)
            if slot.index in failed:
                if self._transport.holds(key):
                    raise ReplicaFailed(f"replica {slot.index} could not load version {key}: {failed[slot.index]}")
                self._forget([key])  # released while we loaded it
                continue
            with self._lock:
                slot.loaded.add(key)

    def _take_out(self, slot: _Slot, reason: str, replica: Replica | None = None) -> None:
        """Out of the ring at once (no new request reaches it); killed and replaced on a thread.
        `replica`: only if it still holds the slot (a late failure of a replaced one is old news)."""
        with self._lock:
            if not slot.up or (replica is not None and slot.replica is not replica):
                return
            slot.up = False
            moved = self._router.remove(slot.index)
            replica = slot.replica
        log.warning("sampler replica %d taken out of the pool (%s); %d session(s) move; starting a replacement",
                    slot.index, reason, len(moved))
        self._transport.detach(slot.index)
        threading.Thread(target=self._replace, args=(slot, replica), name=f"ember-pool-replace-{slot.index}",
                         daemon=True).start()

    def _replace(self, slot: _Slot, dead: Replica) -> None:
        dead.kill()  # its in-flight requests fail now (ReplicaFailed: category server)
        for attempt in itertools.count():
            if self._closed:
                return
            try:
                self._bring_up(slot)
                with self._lock:
                    slot.restarts += 1
                return
            except Exception as exc:  # noqa: BLE001 - retried with back-off: the pool must heal
                delay = _RESTART_BACKOFF_S[min(attempt, len(_RESTART_BACKOFF_S) - 1)]
                log.error("sampler replica %d could not be replaced (%s); retrying in %.0f s", slot.index, exc, delay)
                time.sleep(delay)

    def _watch(self) -> None:
        """The monitor: releases dropped versions, pings replicas, takes out the silent ones."""
        interval = max(0.1, min(2.0, self.config.replica_timeout_s / 4))
        while not self._closed:
            self._wake.wait(interval)
            self._wake.clear()
            if self._closed:
                return
            self._drain_released()
            for slot in list(self._slots):
                reason = self._check(slot)
                if reason:
                    self._take_out(slot, reason)

    def _check(self, slot: _Slot) -> str | None:
        """Why `slot`'s replica must go, or None (sends its next ping when the last was answered)."""
        with self._lock:
            if not slot.up:
                return None
            replica, ping, sent = slot.replica, slot.ping, slot.ping_sent
        if not replica.alive():
            return "its process exited"
        now = time.monotonic()
        if ping is not None and not ping.done():
            silent = now - sent
            return f"no answer for {silent:.1f} s" if silent > self.config.replica_timeout_s else None
        if ping is not None and ping.exception() is not None:
            return f"ping failed: {ping.exception()}"
        with self._lock:
            slot.ping, slot.ping_sent = replica.call("ping"), now
        return None


def _close_at_exit(ref) -> None:
    pool = ref()
    if pool is not None:
        pool.close()
