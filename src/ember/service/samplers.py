"""Sampling sessions: immutable weight snapshots served by one sampler per base model.

A sampling session pins a `WeightVersion` of its base model's sampler (contract 4): the
base weights (version None), a checkpoint read from disk, or a snapshot of a training
run's current weights taken on the run's lane. Sessions are rows in the database; a
session made from a base model or a checkpoint path is re-created lazily after a
restart. A snapshot session (`save_weights_and_get_sampling_client`) keeps its weights in
memory only; a clean stop writes those that hold their run's current weights to disk
(`persist_snapshots`: the run's sampler checkpoint `ember-autosave` and the ids of the
sessions it serves) and they too come back lazily, with the run's in-flight sessions
(`kind="inflight"`, then sampling those saved weights); any other snapshot answers category
`server` after a restart. A clean stop also lets the samples running finish within the
drain bound (`stop_taking`, `drain`; README "Restarts").

Memory: each session keeps its version alive. At most `max_per_session` sessions per
client session stay loaded; the least recently used is evicted (and reloaded on use when it
has a model path), so a sampler used every step, such as a KL reference, stays loaded. An
evicted snapshot cannot be reloaded: its next use is a user error that says so and names
`max_samplers_per_session`.

Fair shares: every request carries its owner to the backend (`SamplingRequest.owner`),
which keeps prefix caches per owner and serves owners round robin; what one owner may
have queued at once is bounded here (`Limits.max_queued_samples_per_key`,
`max_queued_sample_tokens_per_key`: samples x (prompt + max_tokens)), refused as a user
error beyond, because `asample` returns at once and nothing else bounds a backlog.
"""

from __future__ import annotations

import abc
import concurrent.futures
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tinker import types

from ember import failpoints
from ember.sampling.base import Sampler, UnsupportedModelError
from ember.sampling.config import SamplerConfig
from ember.sampling.follow import VersionFollower
from ember.service import checkpoint_files as ckpt
from ember.service.checkpoint_store import AUTOSAVE_NAME, readable
from ember.service.api import NotFoundError, Submission, UserError
from ember.service.clock import SYSTEM_CLOCK, Clock
from ember.service.model_registry import BaseModel, ModelRegistry
from ember.service.faults import public_message
from ember.service.futures import FutureTable, Server, User
from ember.service.limits import Limits, prompt_length
from ember.service.snapshot_store import OlderEntry, OlderVersion, older_dir, parse_older, write_older
from ember.service.requests import SampleRequest
from ember.service.stability import StabilityRecords
from ember.service.store import CheckpointRow, RunRow, SamplerRow, Store

log = logging.getLogger(__name__)


class SamplerFactory(abc.ABC):
    """Builds the sampling backend of one base model (seam for remote/vLLM samplers)."""

    @abc.abstractmethod
    def create(self, base: BaseModel) -> Sampler:
        """A `ember.sampling.Sampler` serving `base`."""

    def resolved_config(self, base: BaseModel, gpu_total_bytes: int | None = None) -> SamplerConfig | None:
        """The `SamplerConfig` `create(base)` would use, when this factory has one (a local
        sampler's, for the server's memory planning); None otherwise (the default)."""
        return None

    def check(self, base: BaseModel) -> None:
        """Raise `UnsupportedModelError` when `create(base)` would get a backend that cannot
        serve `base` (called at start-up for registered models). Default: no check."""

    def syncs_saved(self) -> bool:
        """Whether a named `save_weights_for_sampler` also hands the run's tensors to the
        sampler, so that sampling from the saved path reads no file back (the memory
        transport, `SamplerConfig.weight_sync="memory"`). Default: no."""
        return False


class LocalSamplerFactory(SamplerFactory):
    """Samplers in this process, of the backend `SamplerConfig.backend` names (registry).

    Settings left to follow the trainer are filled in per base model: device, dtype and
    logprob_chunk_tokens from the training engine's config, max_len from the model's max_position_embeddings
    (`ember.sampling.resolve_sampler_config`). Backends that keep versions on disk (vLLM)
    write them under `scratch_dir`.
    """

    def __init__(self, config: Any = None, engine_config: Any = None, scratch_dir: Path | None = None) -> None:
        self.config = config
        self.engine_config = engine_config
        self.scratch_dir = scratch_dir

    def resolved_config(self, base: BaseModel, gpu_total_bytes: int | None = None) -> SamplerConfig:
        """The sampler's config for `base`; `gpu_total_bytes`: the GPU's size for a derived
        vLLM memory share (default: asked of the device, only when one is derived)."""
        from ember.engine.config import EngineConfig
        from ember.sampling import resolve_sampler_config

        engine = self.engine_config or EngineConfig()
        # the trainer's device with its index, and the dtype it computes in (autocast or params)
        config = resolve_sampler_config(self.config, device=engine.device, dtype=engine.autocast_dtype or engine.dtype,
                                        max_position_embeddings=max_positions(base.directory),
                                        logprob_chunk_tokens=engine.logprob_chunk_tokens)
        share = derived_vllm_share(config, engine, base.directory, gpu_total_bytes)
        return resolve_sampler_config(config, device=config.device, dtype=config.dtype, gpu_memory_utilization=share)

    def check(self, base: BaseModel) -> None:
        from ember.sampling.registry import check_model

        check_model(base.directory, self.resolved_config(base))

    def syncs_saved(self) -> bool:
        from ember.sampling.transport.pool import MemoryTransport

        return self.config is not None and self.config.weight_sync == MemoryTransport.mode

    def create(self, base: BaseModel) -> Sampler:
        from ember.sampling import create_sampler

        return create_sampler(base.directory, self.resolved_config(base), scratch_dir=self.scratch_dir)


def derived_vllm_share(config: Any, engine: Any, model_dir: Path, gpu_total_bytes: int | None = None) -> float | None:
    """The vLLM memory share a CUDA vLLM sampler left to derive gets (None otherwise):
    `ember.engine.estimate.vllm_memory_share` of the trainer's estimate beside it, on the
    GPU of `gpu_total_bytes` (default: the device's own total)."""
    from ember.engine.config import cuda_index
    from ember.engine.estimate import trainer_bytes_beside_sampler, vllm_memory_share

    if config.backend != "vllm" or config.gpu_memory_utilization is not None or cuda_index(config.device) is None:
        return None
    shares = any(cuda_index(d) == cuda_index(engine.device) for d in (config.devices or [config.device]))
    try:
        trainer = trainer_bytes_beside_sampler(model_dir, engine, config.colocate) if shares else 0
    except Exception as exc:  # noqa: BLE001 - an architecture the estimator does not know: the fixed default
        log.warning("vLLM memory share: no estimate for %s (%s); using the default", model_dir, exc)
        return None
    if gpu_total_bytes is None:
        gpu_total_bytes = int(torch.cuda.mem_get_info(torch.device(config.device))[1])
    return vllm_memory_share(gpu_total_bytes, trainer, shares_device=shares)


_EVICTED_KEPT = 65536  # evicted snapshot ids remembered, to tell an eviction from a restart
# Beside a run's snapshot save (`persist_snapshots`): the run's weights token and the ids of
# the sampling sessions whose snapshot those weights are.
SNAPSHOT_RECORD = "ember-snapshots.json"
SAMPLE_SHUTDOWN = ("the server shut down before this sample finished (runs.shutdown_drain_s passed): sample again "
                   "once it is back; its sampling session comes back with it")
SAMPLE_STOPPING = "the server is shutting down: this sample was not accepted; submit it again once it is back"


def snapshot_path(run_id: str) -> str:
    """Where a clean stop saves run `run_id`'s weights for its snapshot sampling sessions."""
    return f"tinker://{run_id}/sampler_weights/{AUTOSAVE_NAME}"


@dataclass(frozen=True)
class SnapshotRecord:
    """A snapshot save's `SNAPSHOT_RECORD`: the run's weights token at the stop, the snapshot
    sessions holding those weights, and the run's in-flight sessions (`kind="inflight"`), which
    come back following the saved weights: the run's newest, so "the weights saved when the
    client was created, or newer" holds."""

    weights: str
    snapshots: frozenset[str]
    inflight: frozenset[str] = frozenset()
    older: Mapping[str, OlderEntry] = field(default_factory=dict)  # snapshots of older weights (snapshot_store)


def read_snapshot_record(directory: str) -> SnapshotRecord | None:
    """A snapshot save's `SNAPSHOT_RECORD`; None if unreadable."""
    try:
        record = json.loads((Path(directory) / SNAPSHOT_RECORD).read_text())
        ids, inflight = record["sampling_sessions"], record.get("inflight_sessions", [])
        if not isinstance(record["weights"], str) or not all(isinstance(i, str) for i in [*ids, *inflight]):
            return None
        older = parse_older(record.get("older_sessions", {}))
        return SnapshotRecord(record["weights"], frozenset(ids), frozenset(inflight), older)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _check_policy_head(path: str, directory: Path) -> None:
    """A training checkpoint of a value head has no sampler (it outputs values, not tokens)."""
    from ember.engine.checkpoint import read_meta

    try:
        head = read_meta(directory).get("head", "policy")
    except (OSError, ValueError):
        return  # unreadable metadata: reading the weights reports it
    if head != "policy":
        raise UserError(f"checkpoint {path!r} holds a {head!r} head: it outputs values, not tokens, so a value "
                        "head has no sampler; load it into a training run (create_training_client_from_state) "
                        "and read its values with forward")


def max_positions(model_dir: Path) -> int | None:
    """`max_position_embeddings` from the model's config.json (None when absent or unreadable)."""
    try:
        value = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) and value > 1 else None


@dataclass
class LiveSampler:
    sampler_id: str
    owner: str
    session_id: str
    base: BaseModel
    version: Any  # WeightVersion | None (None = base weights)
    model_path: str | None = None  # loaded from this checkpoint: readable again on every sample
    follows: str | None = None  # kind="inflight": the run whose in-flight target it samples from
    source_run: str | None = None  # a snapshot: the run it was taken of
    weights: str | None = None  # a snapshot: that run's `weights_token` when it was taken


@dataclass
class InflightTarget:
    """A run's in-flight weights (`kind="inflight"`): the newest such save, which every
    in-flight sampling session of the run samples from (docs/architecture.md#in-flight-weights)."""

    session_id: str
    generation: int  # 1 for the run's first in-flight save, +1 for each later one
    version: Any
    follower: Any = None  # `ember.sampling.follow.VersionFollower`: mid-sequence adoption (one per run)


class QueuedWork:
    """Samples and tokens each owner has submitted and not yet finished, bounded per owner."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._by_owner: dict[str, tuple[int, int]] = {}  # owner -> (samples, tokens)

    def reserve(self, owner: str, samples: int, tokens: int) -> None:
        """Count a request's work against its owner, or refuse it (UserError naming the limit)."""
        lim = self.limits
        with self._lock:
            have_samples, have_tokens = self._by_owner.get(owner, (0, 0))
            if have_samples + samples > lim.max_queued_samples_per_key:
                raise UserError(f"this key has {have_samples} samples queued or running; {samples} more would pass "
                                f"the limit max_queued_samples_per_key={lim.max_queued_samples_per_key}: wait "
                                "for earlier samples to finish")
            if have_tokens + tokens > lim.max_queued_sample_tokens_per_key:
                raise UserError(f"this key has {have_tokens} sample tokens (samples x (prompt + max_tokens)) queued "
                                f"or running; {tokens} more would pass the limit max_queued_sample_tokens_per_key="
                                f"{lim.max_queued_sample_tokens_per_key}: wait for earlier samples to finish")
            self._by_owner[owner] = (have_samples + samples, have_tokens + tokens)

    def release(self, owner: str, samples: int, tokens: int) -> None:
        with self._lock:
            have_samples, have_tokens = self._by_owner.get(owner, (0, 0))
            left = (have_samples - samples, have_tokens - tokens)
            if left[0] > 0:
                self._by_owner[owner] = left
            else:
                self._by_owner.pop(owner, None)

    def of(self, owner: str) -> tuple[int, int]:
        with self._lock:
            return self._by_owner.get(owner, (0, 0))

    def total(self) -> tuple[int, int]:
        """(samples, tokens) queued or running, over every owner."""
        with self._lock:
            return sum(s for s, _ in self._by_owner.values()), sum(t for _, t in self._by_owner.values())


def request_work(kwargs: dict[str, Any], default_max_tokens: int) -> tuple[int, int]:
    """(samples, tokens) a sample request asks for: num_samples x (prompt + max_tokens)."""
    samples = kwargs["num_samples"]
    max_tokens = getattr(kwargs.get("sampling_params"), "max_tokens", None)
    new_tokens = max_tokens if isinstance(max_tokens, int) and max_tokens >= 0 else default_max_tokens
    length = prompt_length(kwargs.get("prompt")) or 0  # images without expected_tokens: 1 each
    return samples, samples * (length + new_tokens)


class SamplerManager:
    def __init__(self, store: Store, futures: FutureTable, registry: ModelRegistry, factory: SamplerFactory,
                 max_per_session: int = 32, records: StabilityRecords | None = None,
                 limits: Limits | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        self.store, self.futures, self.registry, self.factory = store, futures, registry, factory
        self._clock = clock  # checkpoint expiry, creation times (ember.service.clock)
        self.records = records  # where record_stability_info samples are kept (None: refused)
        self.max_per_session = max_per_session
        self.queued = QueuedWork(limits or Limits())
        self._samplers: dict[Path, Any] = {}
        self._names: dict[Path, str] = {}  # base model directory -> its name (metrics labels)
        self._live: dict[str, OrderedDict[str, LiveSampler]] = {}  # session_id -> sampler_id -> live
        self._by_id: dict[str, LiveSampler] = {}  # sampler_id -> live, for every loaded session
        self._evicted: OrderedDict[str, None] = OrderedDict()  # snapshot sampler ids evicted (bounded)
        self._lock = threading.RLock()
        self._finisher = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="ember-sample-finish")
        self._sync_listeners: list[Callable[[str, float], None]] = []
        # run_id -> (its session id, tinker path, base, version): `sync_saved`
        self._synced: dict[str, tuple[str, str, BaseModel, Any]] = {}
        self._inflight: dict[str, InflightTarget] = {}  # run_id -> its in-flight target
        self._running: dict[str, tuple[str, Any]] = {}  # request_id -> (owner, backend Future): `cancel`
        self._running_lock = threading.Lock()  # not `_lock`: a sampler's creation holds that for minutes
        self._stopping = False  # a clean stop began: new samples are refused (`stop_taking`)

    # ------------------------------------------------------------------ backends and versions
    def backend(self, base: BaseModel) -> Sampler:
        with self._lock:
            sampler = self._samplers.get(base.directory)
            if sampler is None:
                start = time.monotonic()
                try:
                    sampler = self._samplers[base.directory] = self.factory.create(base)
                    self._names[base.directory] = base.name
                except UnsupportedModelError as exc:  # the model asked for, not ember, is the cause
                    raise UserError(f"base model {base.name!r}: the sampler backend cannot serve it: {exc}") from exc
                log.info("sampler loaded for base model %s (%s, %.1f s)", base.name, type(sampler).__name__,
                         time.monotonic() - start)
            return sampler

    def replica_stats(self) -> dict[str, list[dict]]:
        """Per base model served by a pool of replicas: each replica's `up` and
        `requests_total` (`SamplerPool.replica_stats`); models with one sampler are absent."""
        # No lock: creating a sampler holds it for minutes, and a scrape must not wait for that.
        samplers = dict(self._samplers).items()  # a dict copy is atomic under the GIL
        stats = {self._names.get(d, str(d)): s.replica_stats() for d, s in samplers}
        return {name: per_replica for name, per_replica in stats.items() if per_replica is not None}

    def sampler_load(self) -> dict[str, dict[str, int]]:
        """Per base model whose sampler reports it (`TorchSampler.load`): sequences decoding
        now and requests waiting for a slot. Read-only: /metrics reports it."""
        samplers = dict(self._samplers).items()  # no lock, as replica_stats
        loads = {self._names.get(d, str(d)): s.load() for d, s in samplers}
        return {name: load for name, load in loads.items() if load is not None}

    def check_registered(self) -> None:
        """Refuse to start (ValueError naming model, field and what is supported) when a
        registered model cannot be served by the sampler backend: at start-up, not at the
        first sample (`Sampler.check_model`)."""
        for name in self.registry.names():
            try:
                self.factory.check(self.registry.resolve(name))
            except UnsupportedModelError as exc:
                raise ValueError(f"model {name!r}: the sampler backend cannot serve it: {exc}") from exc

    @property
    def syncs_saved(self) -> bool:
        """Whether `save_weights_for_sampler(path)` also hands the tensors over (`sync_saved`;
        `SamplerFactory.syncs_saved`)."""
        return self.factory.syncs_saved()

    def add_sync_listener(self, listener: Callable[[str, float], None]) -> None:
        """Call `listener(mode, seconds)` after every new version reaches a sampler: mode
        "memory" for a run's tensors handed over, "files" for a checkpoint read from disk
        (the server's `ember_weight_sync_seconds` histogram)."""
        self._sync_listeners.append(listener)

    def _load(self, base: BaseModel, weights: Iterable[tuple[str, torch.Tensor]], lora: types.LoraConfig | None,
              mode: str = "memory", start: float | None = None):
        start = time.monotonic() if start is None else start
        version = self.backend(base).load_weights(weights, lora)
        for listener in self._sync_listeners:
            listener(mode, time.monotonic() - start)
        return version

    def sync_saved(self, run_id: str, path: str, base: BaseModel, weights: Iterable[tuple[str, torch.Tensor]],
                   lora: types.LoraConfig | None, session_id: str = "") -> None:
        """Memory mode: `save_weights_for_sampler(path)` also hands the run's tensors to the
        sampler, so sampling from `path` reads no file back. One such version per run is kept
        (the newest), and only while the run's session lasts and its checkpoint exists
        (`drop_session`, `release_synced`): sampling clients made from it hold the version
        themselves, as with files; after that, the path is read from its files as before."""
        version = self._load(base, weights, lora)
        with self._lock:
            self._synced[run_id] = (session_id, path, base, version)

    def _synced_version(self, path: str) -> tuple[BaseModel, Any] | None:
        with self._lock:
            for _, synced_path, base, version in self._synced.values():
                if synced_path == path:
                    return base, version
        return None

    def synced_paths(self) -> list[str]:
        """The checkpoint paths whose tensors the service holds for sampling (read-only)."""
        with self._lock:
            return sorted(entry[1] for entry in self._synced.values())

    def release_synced(self, exists: Callable[[str], bool]) -> int:
        """Let go of the synced versions whose checkpoint is gone (`exists(path)` False:
        deleted, expired), as a deleted checkpoint's files go; how many. The sampler frees a
        version once no sampling client holds it either."""
        with self._lock:
            entries = list(self._synced.items())
        gone = [run_id for run_id, (_, path, _, _) in entries if not exists(path)]
        with self._lock:
            for run_id in gone:
                self._synced.pop(run_id, None)
        return len(gone)

    def _version_from_checkpoint(self, owner: str, path: str) -> tuple[BaseModel, Any]:
        tpath, crow = readable(self.store, owner, path, self._clock())  # the owner's, or a published one
        synced = self._synced_version(tpath.uri)  # after the access check, never instead of it
        if synced is not None:
            return synced
        run = self.store.get(RunRow, crow.run_id)
        if run is None:
            raise UserError(f"checkpoint {path!r} has no training run record")
        base = self.registry.resolve(run.base_model)
        lora = types.LoraConfig(**run.lora_config) if run.lora_config else None
        d = Path(crow.directory)
        if tpath.kind == "external":
            raise UserError(f"checkpoint {path!r} is an external-weights export (for download); sample from a "
                            "tinker://<run>/sampler_weights/<name> or tinker://<run>/weights/<name> path")
        if tpath.kind == "training":
            _check_policy_head(path, d)
        start = time.monotonic()  # the read counts: it is the files mode's cost
        weights = ckpt.read_state_weights(d) if tpath.kind == "training" else ckpt.read_sampler_weights(d)
        try:
            return base, self._load(base, weights.items(), lora, mode="files", start=start)
        except UserError as exc:  # the backend refused the tensors: the checkpoint's content, not our fault
            raise UserError(f"checkpoint {path!r} cannot be sampled from: {exc}") from None

    # ------------------------------------------------------------------ sessions
    def _remember(self, live: LiveSampler) -> None:
        with self._lock:
            group = self._live.setdefault(live.session_id, OrderedDict())
            group[live.sampler_id] = live
            group.move_to_end(live.sampler_id)
            self._by_id[live.sampler_id] = live
            while len(group) > self.max_per_session:
                evicted, _ = group.popitem(last=False)
                self._by_id.pop(evicted, None)
                self._evicted[evicted] = None
                while len(self._evicted) > _EVICTED_KEPT:
                    self._evicted.popitem(last=False)
                # routine (an RL loop makes a sampling client per step): not an operator's line
                log.debug("sampling session %s evicted (more than %d loaded)", evicted, self.max_per_session)

    def _existing(self, session_id: str, seq: int | None) -> SamplerRow | None:
        if seq is None:
            return None
        return self.store.sampler_by_seq(session_id, seq)

    def _new_row(self, owner, session_id, seq, base: BaseModel, model_path, source_run_id) -> SamplerRow:
        row = SamplerRow(
            id=f"{session_id}:sample:{seq}" if seq is not None else f"{session_id}:sample:{uuid.uuid4().hex[:12]}",
            owner=owner, session_id=session_id, sampling_session_seq_id=seq, base_model=base.name,
            model_path=model_path, source_run_id=source_run_id, created_at=self._clock(),
        )
        self.store.add(row)
        return row

    def create(self, owner: str, session_id: str, seq: int, base_model: str | None, model_path: str | None) -> str:
        """Direct creation from a base model or a checkpoint path. Returns the sampler id."""
        if (base_model is None) == (model_path is None):
            raise UserError("create_sampling_session needs exactly one of base_model and model_path")
        if not isinstance(seq, int) or seq < 0:
            raise UserError(f"sampling_session_seq_id must be an integer >= 0, got {seq!r}")
        row = self._existing(session_id, seq)
        if row is not None:
            if row.owner != owner:
                raise NotFoundError(f"unknown session {session_id!r}")
            return row.id
        if model_path is not None:
            base, version = self._version_from_checkpoint(owner, model_path)
        else:
            base, version = self.registry.resolve(base_model), None
            self.backend(base)
        row = self._new_row(owner, session_id, seq, base, model_path, None)
        self._remember(LiveSampler(row.id, owner, session_id, base, version, model_path))
        log.debug("sampling session %s loaded for %s: %s", row.id, owner, model_path or f"base model {base.name}")
        return row.id

    def create_from_weights(self, owner: str, session_id: str, seq: int | None, base: BaseModel,
                            weights: Iterable[tuple[str, torch.Tensor]], lora: types.LoraConfig | None,
                            source_run_id: str, inflight: bool = False, weights_token: str | None = None) -> str:
        """Snapshot a run's current weights (called on the run's lane). `inflight`: the
        weights also become the run's in-flight target, which this sampling session and
        every earlier in-flight one of the run sample from, from their next request on.
        `weights_token`: the run's `LiveRun.weights_token` (a clean stop keeps the snapshot
        while the run still holds those weights: `persist_snapshots`)."""
        row = self._existing(session_id, seq)
        if row is not None and row.id in self._live.get(session_id, {}):
            return row.id  # a retried save: done already
        version = self._load(base, weights, lora)
        if inflight:
            self._publish(source_run_id, session_id, version)
        if row is None:
            row = self._new_row(owner, session_id, seq, base, None, source_run_id)
        self._remember(LiveSampler(row.id, owner, session_id, base, version,
                                   follows=source_run_id if inflight else None, source_run=source_run_id,
                                   weights=weights_token))
        return row.id

    def _publish(self, run_id: str, session_id: str, version: Any) -> None:
        with self._lock:
            previous = self._inflight.get(run_id)
            generation = previous.generation + 1 if previous is not None else 1
            follower = previous.follower if previous is not None else VersionFollower(version, generation)
            if previous is not None:
                follower.publish(version)  # running followed sequences switch at their next decode step
            self._inflight[run_id] = InflightTarget(session_id, generation, version, follower)
        log.debug("run %s: in-flight weights generation %d published", run_id, generation)

    def debug_state(self) -> dict[str, Any]:
        """The one inspection point of the manager (read-only): `backends` (base model name ->
        its started sampler backend), `inflight_generations` (run id -> how many in-flight
        saves it has published)."""
        samplers = dict(self._samplers).items()  # no lock, as replica_stats
        with self._lock:
            inflight = {run_id: target.generation for run_id, target in self._inflight.items()}
        return {"backends": {self._names.get(d, str(d)): s for d, s in samplers}, "inflight_generations": inflight}

    def _version_for(self, live: LiveSampler) -> Any:
        """The weights a new request of `live` samples from: its own snapshot, or for an
        in-flight session the run's newest in-flight target (kept to the end of the request unless
        the backend follows mid-sequence: `_follower_for`)."""
        if live.follows is None:
            return live.version
        with self._lock:
            target = self._inflight.get(live.follows)
        return target.version if target is not None else live.version

    def _follower_for(self, live: LiveSampler, backend) -> Any:
        """An in-flight session's run follower when `backend` adopts versions mid-sequence
        (`Sampler.follows_mid_sequence`), else None: the request keeps its version."""
        if live.follows is None or not backend.follows_mid_sequence:
            return None
        with self._lock:
            target = self._inflight.get(live.follows)
        return target.follower if target is not None else None
    def loaded_total(self) -> int:
        """Sampling sessions loaded now, over every owner."""
        with self._lock:
            return len(self._by_id)

    def loaded_count(self, owner: str) -> int:
        """Sampling sessions of `owner` loaded now (`limits.max_sampling_sessions_per_key`)."""
        with self._lock:
            return sum(1 for live in self._by_id.values() if live.owner == owner)

    def row(self, owner: str, sampler_id: str) -> SamplerRow:
        row = self.store.get(SamplerRow, sampler_id)
        if row is None or row.owner != owner:
            raise NotFoundError(f"unknown sampling session {sampler_id!r}")
        return row

    def _resolve(self, owner: str, sampler_id: str) -> LiveSampler:
        with self._lock:  # a loaded session needs no database read (its row is immutable)
            live = self._by_id.get(sampler_id)
            if live is not None and live.owner == owner:
                self._live[live.session_id].move_to_end(sampler_id)  # eviction takes the least recently used
                return live
        row = self.row(owner, sampler_id)
        with self._lock:
            live = self._live.get(row.session_id, {}).get(sampler_id)
        if live is not None:
            return live
        if row.model_path is None and row.source_run_id is not None:
            with self._lock:
                evicted = sampler_id in self._evicted
            if evicted:
                raise UserError(
                    f"sampling session {sampler_id} held an in-memory snapshot that is gone: it was evicted, because "
                    f"a client session keeps at most {self.max_per_session} sampling clients loaded "
                    "(ServiceConfig.max_samplers_per_session) and it was the least recently used when another was "
                    "created; create a new sampling client (save_weights_and_get_sampling_client), keep fewer "
                    "sampling clients per session, or save the weights to a path (save_weights_for_sampler) so that "
                    "they are reloaded after an eviction")
            restored = self._from_snapshot_save(row)
            if restored is None:
                raise RuntimeError(
                    f"sampling session {sampler_id} held an in-memory snapshot that is gone (server restarted or "
                    "session evicted); create a new sampling client"
                )
            return restored
        if row.model_path is not None:
            base, version = self._version_from_checkpoint(owner, row.model_path)
        else:
            base, version = self.registry.resolve(row.base_model), None
        live = LiveSampler(row.id, owner, row.session_id, base, version, row.model_path)
        self._remember(live)
        return live

    def _from_snapshot_save(self, row: SamplerRow) -> LiveSampler | None:
        """A snapshot session back after a restart, from its run's snapshot save
        (`persist_snapshots`); None when that save does not hold it."""
        crow = self.store.get(CheckpointRow, snapshot_path(row.source_run_id))
        record = read_snapshot_record(crow.directory) if crow is not None else None
        if record is None or row.id not in record.snapshots | record.inflight | record.older.keys():
            return None
        directory, token = Path(crow.directory), record.weights
        if row.id in record.older:  # a snapshot of older weights: their own subfolder
            try:
                directory, token = older_dir(directory, record.older[row.id].folder), record.older[row.id].weights
            except ValueError as exc:
                log.error("sampling session %s not restored: %s names a folder outside the run's automatic save "
                          "(%s); refused", row.id, SNAPSHOT_RECORD, exc)
                return None
        run = self.store.get(RunRow, row.source_run_id)
        base = self.registry.resolve(row.base_model)
        lora = types.LoraConfig(**run.lora_config) if run is not None and run.lora_config else None
        start = time.monotonic()
        weights = ckpt.read_sampler_weights(directory)
        version = self._load(base, weights.items(), lora, mode="files", start=start)
        follows = row.source_run_id if row.id in record.inflight else None  # a later in-flight save: followed
        live = LiveSampler(row.id, row.owner, row.session_id, base, version, follows=follows,
                           source_run=row.source_run_id, weights=token)
        self._remember(live)
        log.debug("sampling session %s back from %s", row.id, crow.tinker_path)
        return live

    def get(self, owner: str, sampler_id: str) -> types.GetSamplerResponse:
        row = self.row(owner, sampler_id)
        return types.GetSamplerResponse(sampler_id=row.id, base_model=row.base_model, model_path=row.model_path)

    # ------------------------------------------------------------------ sampling
    def sample(self, owner: str, request: SampleRequest) -> Submission:
        """Raises NotFoundError when the sampler's checkpoint is no longer readable by
        `owner` (unpublished, expired, deleted), like a path never saved."""
        sampler_id, seq_id, record = request.sampling_session_id, request.seq_id, bool(request.record_stability_info)
        request_kwargs = request.sampler_arguments()  # what the backend's SamplingRequest takes
        self._check_checkpoint_readable(owner, sampler_id)
        num = request_kwargs.get("num_samples")
        key = f"sample:{sampler_id}:{seq_id}" if seq_id is not None else None
        n_ids = num if isinstance(num, int) and num >= 1 else 0
        sub, created = self.futures.create(owner, "Sample", dedup_key=key, num_sequences=n_ids)
        if created:
            with self.futures.accepting(sub.request_id):
                self._start_sample(sub, owner, sampler_id, num, request_kwargs, record)
        return sub

    def _check_checkpoint_readable(self, owner: str, sampler_id: str) -> None:
        with self._lock:
            live = self._by_id.get(sampler_id)
        if live is not None and live.owner == owner:
            path = live.model_path
        else:
            row = self.store.get(SamplerRow, sampler_id)
            path = row.model_path if row is not None and row.owner == owner else None  # else: _resolve's 404
        if path is not None:
            readable(self.store, owner, path, self._clock())

    def _start_sample(self, sub: Submission, owner: str, sampler_id: str, num: Any, kwargs: dict[str, Any],
                      record: bool) -> None:
        if self._stopping:
            self.futures.fail(sub.request_id, SAMPLE_STOPPING, Server)
            return
        try:
            if not sub.sample_sequence_ids:
                raise UserError(f"num_samples must be an integer >= 1, got {num!r}")
            if record and self.records is None:
                raise UserError("record_stability_info=True: this service keeps no stability records")
            live = self._resolve(owner, sampler_id)
        except (UserError, NotFoundError) as exc:
            self.futures.fail(sub.request_id, str(exc), User)
            return
        except Exception as exc:  # noqa: BLE001
            log.exception("sampler %s could not be resolved", sampler_id)
            self.futures.fail(sub.request_id, public_message(exc), Server)
            return
        self._dispatch(sub, live, kwargs, record)

    def _dispatch(self, sub: Submission, live: LiveSampler, kwargs: dict[str, Any], record: bool = False) -> None:
        from ember.sampling.base import SamplingRequest, submit_streaming

        rid = sub.request_id
        reserved = None
        try:
            backend = self.backend(live.base)
            work = request_work(kwargs, backend.default_max_tokens)
            self.queued.reserve(live.owner, *work)
            reserved = work
            request = SamplingRequest(version=self._version_for(live), sequence_ids=sub.sample_sequence_ids,
                                      owner=live.owner, session=live.sampler_id,
                                      follow=self._follower_for(live, backend), **kwargs)
            failpoints.hit("sampler.submit")
            fut = submit_streaming(backend, request)  # `on_tokens` in kwargs: a streamed request
        except UserError as exc:  # validation refused the request: the caller's to fix
            self._release(live.owner, reserved)
            self.futures.fail(rid, str(exc), User)
            return
        except Exception as exc:  # noqa: BLE001
            self._release(live.owner, reserved)
            log.exception("sample %s could not be submitted", rid)
            self.futures.fail(rid, public_message(exc), Server)
            return
        # Finished on the finisher threads, not the sampler's: a slow database write
        # (retried while locked) must not hold up the decode step of every other request.
        keep = (live.owner, live.session_id, kwargs["prompt"]) if record else None
        with self._running_lock:
            self._running[rid] = (live.owner, fut)
        fut.add_done_callback(lambda f: self._done(rid, f, keep, live.owner, work))

    def cancel(self, owner: str, request_id: str) -> bool:
        """Give up on `owner`'s sample `request_id` (a streaming client hung up): the backend
        frees its slots at its next step (`Sampler.streams_tokens`) and the future fails.
        False when it is not running (finished, unknown, or another owner's)."""
        with self._running_lock:
            found = self._running.get(request_id)
        return found is not None and found[0] == owner and found[1].cancel()

    def _done(self, rid: str, fut, keep, owner: str, work: tuple[int, int]) -> None:
        """On the backend's thread: the owner's queued work is released at once, the rest is the finisher's."""
        with self._running_lock:
            self._running.pop(rid, None)
        self._release(owner, work)
        self._finisher.submit(self._finish, rid, fut, keep)

    def _release(self, owner: str, work: tuple[int, int] | None) -> None:
        if work is not None:
            self.queued.release(owner, *work)

    def _finish(self, rid: str, fut, keep: tuple[str, str, types.ModelInput] | None = None) -> None:
        if fut.cancelled():
            self.futures.fail(rid, "the sample was cancelled by its client", User)
            return
        exc = fut.exception()
        if exc is None and keep is not None:
            try:  # before the future completes: a client holding the sample can train on it at once
                self.records.record(*keep, fut.result())
            except Exception as rec_exc:  # noqa: BLE001 - our fault, reported as such
                log.exception("sample %s: stability records not kept", rid)
                self.futures.fail(rid, public_message(rec_exc), Server)
                return
        if exc is None:
            self.futures.complete(rid, fut.result())
        elif isinstance(exc, UserError):
            self.futures.fail(rid, str(exc), User)
        else:  # any other exception, a ValueError from torch included, is a bug of ours
            log.error("sample %s failed", rid, exc_info=exc)
            self.futures.fail(rid, public_message(exc), Server)

    # ------------------------------------------------------------------ a clean stop
    def snapshots_of(self, run_id: str, weights_token: str) -> list[str]:
        """Ids of the loaded snapshot sampling sessions of run `run_id` that hold its weights
        `weights_token` (in-flight sessions left out: they follow the run's newest target)."""
        with self._lock:
            return sorted(live.sampler_id for live in self._by_id.values() if live.follows is None
                          and live.source_run == run_id and live.weights == weights_token)

    def older_of(self, run_id: str, weights_token: str) -> dict[str, list[LiveSampler]]:
        """The loaded snapshot sampling sessions of run `run_id` that hold older weights than
        `weights_token`, by the weights token they hold."""
        with self._lock:
            lives = [live for live in self._by_id.values() if live.follows is None and live.source_run == run_id
                     and live.weights is not None and live.weights != weights_token]
        out: dict[str, list[LiveSampler]] = {}
        for live in sorted(lives, key=lambda x: x.sampler_id):
            out.setdefault(live.weights, []).append(live)
        return out

    def inflight_of(self, run_id: str) -> list[str]:
        """Ids of the loaded in-flight sampling sessions (`kind="inflight"`) that follow run `run_id`."""
        with self._lock:
            return sorted(live.sampler_id for live in self._by_id.values() if live.follows == run_id)

    def persist_snapshots(self, checkpoints: Any, run_id: str, owner: str, weights_token: str,
                          export: Callable[[Path], None]) -> int:
        """After a run's automatic save (on its lane: a clean stop's, or every
        `runs.autosave_every_steps`): when loaded snapshot sessions hold the run's current
        weights, or in-flight sessions follow the run, `export` writes the run's weights as
        its sampler checkpoint `ember-autosave` (a `CheckpointStore` automatic save:
        quota-exempt, replaced each time) with `SNAPSHOT_RECORD` naming those sessions, each
        of which comes back from it after the restart (`_from_snapshot_save`; an in-flight
        one then samples the run's weights at the stop, never older than its in-flight
        target, until the run's next in-flight save). Snapshot sessions of older weights are
        kept in subfolders of the same save when the sampler gives their tensors back
        (`ember.service.snapshot_store`). Bounded: one save per run, one folder per version a
        live session holds. How many sessions were kept."""
        ids, inflight = self.snapshots_of(run_id, weights_token), self.inflight_of(run_id)
        older = self.older_of(run_id, weights_token)
        if not ids and not inflight and not older:
            return 0
        previous = self.store.get(CheckpointRow, snapshot_path(run_id))
        kept: dict[str, dict[str, str]] = {}

        def write(tmp: Path) -> None:
            tmp.mkdir(parents=True, exist_ok=True)
            if ids or inflight:
                export(tmp)
            for token, lives in older.items():
                folder = write_older(tmp, Path(previous.directory) if previous else None, self._older(lives[0]))
                kept.update({live.sampler_id: {"folder": folder, "weights": token} for live in lives if folder})
            (tmp / SNAPSHOT_RECORD).write_text(json.dumps({
                "weights": weights_token, "sampling_sessions": ids, "inflight_sessions": inflight,
                "older_sessions": kept}))

        total = len(ids) + len(inflight) + sum(len(lives) for lives in older.values())
        try:
            checkpoints.save(run_id, owner, "sampler", AUTOSAVE_NAME, write, overwrite=True)
        except Exception as exc:  # noqa: BLE001 - the run itself is saved; say why its samplers are not
            log.warning("run %s: %d sampling session(s) not saved for a restart: %s", run_id, total,
                        public_message(exc))
            return 0
        saved = ids + inflight + sorted(kept)
        log.debug("run %s: sampling sessions %s saved for the restart", run_id, ", ".join(saved))
        return len(saved)

    def _older(self, live: LiveSampler) -> OlderVersion:
        """What `snapshot_store.write_older` needs of the version `live` holds."""
        sampler, version = self.backend(live.base), live.version
        return OlderVersion(live.weights, lambda: sampler.version_weights(version),
                            version.lora_rank if version.is_lora else None, live.base.name)

    def stop_taking(self) -> None:
        """A clean stop began: every new sample is refused (category server, `SAMPLE_STOPPING`)."""
        self._stopping = True

    def drain(self, timeout_s: float) -> int:
        """Let the samples running finish for up to `timeout_s`; fail those still running then
        (category server, `SAMPLE_SHUTDOWN`: the client samples again after the restart). How
        many failed so."""
        with self._running_lock:
            running = [fut for _, fut in self._running.values()]
        concurrent.futures.wait(running, timeout=max(0.0, timeout_s))
        with self._running_lock:
            left = list(self._running)
        for rid in left:
            self.futures.fail(rid, SAMPLE_SHUTDOWN, Server)
        return len(left)

    def sleep_all(self) -> None:
        """Colocation: every sampler that shares the trainer's GPU releases it (backends
        without a sleep mode ignore this); each wakes on its next request."""
        with self._lock:
            samplers = list(self._samplers.values())
        for sampler in samplers:
            sampler.sleep()

    def drop_session(self, session_id: str) -> None:
        with self._lock:
            for sampler_id in self._live.pop(session_id, {}):
                self._by_id.pop(sampler_id, None)
            for run_id in [r for r, entry in self._synced.items() if entry[0] == session_id]:
                del self._synced[run_id]  # its runs are unloaded: their saved paths read files again
            for run_id in [r for r, target in self._inflight.items() if target.session_id == session_id]:
                del self._inflight[run_id]

    def close(self) -> None:
        with self._lock:
            samplers, self._samplers = list(self._samplers.values()), {}
            self._live.clear()
            self._by_id.clear()
            self._synced.clear()
            self._inflight.clear()
        for s in samplers:
            try:
                s.close()
            except Exception:  # noqa: BLE001
                log.exception("closing a sampler failed")
        self._finisher.shutdown(wait=True)  # the samplers' last results are written
