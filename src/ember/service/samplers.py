"""Sampling sessions: immutable weight snapshots served by one sampler per base model.

A sampling session pins a `WeightVersion` of its base model's sampler (contract 4): the
base weights (version None), a checkpoint read from disk, or a snapshot of a training
run's current weights taken on the run's lane. Sessions are rows in the database; a
session made from a base model or a checkpoint path is re-created lazily after a
restart. A snapshot session (`save_weights_and_get_sampling_client`) keeps its weights in
memory only; each automatic save of the run (a clean stop's, or periodic) writes them to
disk (`persist_snapshots`: the run's sampler checkpoint `ember-autosave` and the ids of the
sessions it serves; older weights in its subfolders when the sampler gives them back) and
they too come back lazily, with the run's in-flight sessions (`kind="inflight"`, then
sampling those saved weights); any other snapshot answers category `server` after a restart. A clean stop also lets the samples running finish within the
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

`SamplerManager` composes one component per responsibility: `BackendCache`
(`service/sampler_backends.py`: a sampler per base model, version loading), `SamplerVersions`
(`service/sampler_versions.py`: checkpoint reads through `CheckpointStore`, memory-synced
versions, in-flight targets), `SessionTable` (`service/sampler_sessions.py`: loaded sessions,
eviction), `SnapshotSaves` (`service/sampler_snapshots.py`: an automatic save's snapshot save
and restore; older versions' subfolders in `service/snapshot_store.py`) and `SampleDispatcher`
(`service/sample_dispatch.py`: queued work per owner, submission, cancellation, stability
records, the drain). What is left here resolves a sampling session's
row to a loaded one and creates sessions.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from tinker import types

from ember.sampling.base import Sampler
from ember.service.api import NotFoundError, Submission, UserError
from ember.service.checkpoint_store import CheckpointStore
from ember.service.clock import SYSTEM_CLOCK, Clock
from ember.service.faults import public_message
from ember.service.futures import FutureTable, Server, User
from ember.service.limits import Limits
from ember.service.model_registry import BaseModel, ModelRegistry
from ember.service.quotas import QueuedWork, request_work
from ember.service.requests import SampleRequest
from ember.service.sample_dispatch import SAMPLE_SHUTDOWN, SAMPLE_STOPPING, SampleDispatcher
from ember.service.sampler_backends import (BackendCache, LocalSamplerFactory, SamplerFactory, derived_vllm_share,
                                            max_positions)
from ember.service.sampler_sessions import LiveSampler, SessionTable
from ember.service.sampler_snapshots import SNAPSHOT_RECORD, SnapshotRecord, SnapshotSaves, snapshot_path
from ember.service.sampler_versions import InflightTarget, SamplerVersions
from ember.service.stability import StabilityRecords
from ember.service.store import SamplerRow, Store

__all__ = [  # the names callers import from here (their homes: the modules above)
    "InflightTarget", "LiveSampler", "LocalSamplerFactory", "QueuedWork", "SAMPLE_SHUTDOWN", "SAMPLE_STOPPING",
    "SNAPSHOT_RECORD", "SamplerFactory", "SamplerManager", "SnapshotRecord", "derived_vllm_share", "max_positions",
    "request_work", "snapshot_path",
]

log = logging.getLogger(__name__)


class SamplerManager:
    """The sampling sessions of every owner: a facade over the components named above."""

    def __init__(self, store: Store, futures: FutureTable, registry: ModelRegistry, factory: SamplerFactory,
                 max_per_session: int = 32, records: StabilityRecords | None = None,
                 limits: Limits | None = None, clock: Clock = SYSTEM_CLOCK, *,
                 checkpoints: CheckpointStore) -> None:
        self.store, self.futures, self.registry, self.factory = store, futures, registry, factory
        self._clock = clock  # creation times (ember.service.clock); checkpoint expiry is `checkpoints`'
        self.records = records  # where record_stability_info samples are kept (None: refused)
        self.max_per_session = max_per_session
        self.checkpoints = checkpoints
        self.backends = BackendCache(factory, registry)
        self.versions = SamplerVersions(store, registry, self.backends, checkpoints)
        self.sessions = SessionTable(max_per_session)
        self.snapshots = SnapshotSaves(store, registry, self.backends, self.sessions, checkpoints)
        self.dispatcher = SampleDispatcher(futures, self.backends, limits or Limits(), records)
        self.queued = self.dispatcher.queued

    # ------------------------------------------------------------------ backends and versions
    def backend(self, base: BaseModel) -> Sampler:
        return self.backends.backend(base)

    def replica_stats(self) -> dict[str, list[dict]]:
        """`BackendCache.replica_stats`: per base model served by a pool, each replica's state."""
        return self.backends.replica_stats()

    def sampler_load(self) -> dict[str, dict[str, int]]:
        """`BackendCache.sampler_load`: per base model, sequences decoding and requests waiting."""
        return self.backends.sampler_load()

    def check_registered(self) -> None:
        """`BackendCache.check_registered`: refuse to start when a registered model cannot be sampled."""
        self.backends.check_registered()

    @property
    def syncs_saved(self) -> bool:
        """Whether `save_weights_for_sampler(path)` also hands the tensors over (`sync_saved`;
        `SamplerFactory.syncs_saved`)."""
        return self.factory.syncs_saved()

    def add_sync_listener(self, listener: Callable[[str, float], None]) -> None:
        """`BackendCache.add_sync_listener`: `listener(mode, seconds)` after every new version."""
        self.backends.add_sync_listener(listener)

    def sync_saved(self, run_id: str, path: str, base: BaseModel, weights: Iterable[tuple[str, torch.Tensor]],
                   lora: types.LoraConfig | None, session_id: str = "") -> None:
        """`SamplerVersions.sync_saved`: memory mode's save hands the run's tensors over."""
        self.versions.sync_saved(run_id, path, base, weights, lora, session_id)

    def synced_paths(self) -> list[str]:
        """The checkpoint paths whose tensors the service holds for sampling (read-only)."""
        return self.versions.synced_paths()

    def release_synced(self, exists: Callable[[str], bool]) -> int:
        """`SamplerVersions.release_synced`: drop the synced versions whose checkpoint is gone."""
        return self.versions.release_synced(exists)

    def debug_state(self) -> dict[str, Any]:
        """The one inspection point of the manager (read-only): `backends` (base model name ->
        its started sampler backend), `inflight_generations` (run id -> how many in-flight
        saves it has published)."""
        return {"backends": self.backends.started(), "inflight_generations": self.versions.inflight_generations()}

    # ------------------------------------------------------------------ sessions
    def _new_row(self, owner, session_id, seq, base: BaseModel, model_path, source_run_id) -> SamplerRow:
        row = SamplerRow(
            id=f"{session_id}:sample:{seq}" if seq is not None else f"{session_id}:sample:{uuid.uuid4().hex[:12]}",
            owner=owner, session_id=session_id, sampling_session_seq_id=seq, base_model=base.name,
            model_path=model_path, source_run_id=source_run_id, created_at=self._clock(),
        )
        self.store.add(row)
        return row

    def _existing(self, session_id: str, seq: int | None) -> SamplerRow | None:
        if seq is None:
            return None
        return self.store.sampler_by_seq(session_id, seq)

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
            base, version = self.versions.from_checkpoint(owner, model_path)
        else:
            base, version = self.registry.resolve(base_model), None
            self.backend(base)
        row = self._new_row(owner, session_id, seq, base, model_path, None)
        self.sessions.remember(LiveSampler(row.id, owner, session_id, base, version, model_path))
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
        if row is not None and self.sessions.in_session(session_id, row.id) is not None:
            return row.id  # a retried save: done already
        version = self.backends.load(base, weights, lora)
        if inflight:
            self.versions.publish(source_run_id, session_id, version)
        if row is None:
            row = self._new_row(owner, session_id, seq, base, None, source_run_id)
        self.sessions.remember(LiveSampler(row.id, owner, session_id, base, version,
                                           follows=source_run_id if inflight else None, source_run=source_run_id,
                                           weights=weights_token))
        return row.id

    def loaded_total(self) -> int:
        """Sampling sessions loaded now, over every owner."""
        return self.sessions.loaded_total()

    def loaded_count(self, owner: str) -> int:
        """Sampling sessions of `owner` loaded now (`limits.max_sampling_sessions_per_key`)."""
        return self.sessions.loaded_count(owner)

    def row(self, owner: str, sampler_id: str) -> SamplerRow:
        row = self.store.get(SamplerRow, sampler_id)
        if row is None or row.owner != owner:
            raise NotFoundError(f"unknown sampling session {sampler_id!r}")
        return row

    def _resolve(self, owner: str, sampler_id: str) -> LiveSampler:
        live = self.sessions.used(owner, sampler_id)
        if live is not None:
            return live
        row = self.row(owner, sampler_id)
        live = self.sessions.in_session(row.session_id, sampler_id)
        if live is not None:
            return live
        if row.model_path is None and row.source_run_id is not None:
            return self._restored(row)
        if row.model_path is not None:
            base, version = self.versions.from_checkpoint(owner, row.model_path)
        else:
            base, version = self.registry.resolve(row.base_model), None
        live = LiveSampler(row.id, owner, row.session_id, base, version, row.model_path)
        self.sessions.remember(live)
        return live

    def _restored(self, row: SamplerRow) -> LiveSampler:
        """A snapshot session that is not loaded: back from its run's snapshot save, or an error saying why not."""
        if self.sessions.was_evicted(row.id):
            raise UserError(
                f"sampling session {row.id} held an in-memory snapshot that is gone: it was evicted, because "
                f"a client session keeps at most {self.max_per_session} sampling clients loaded "
                "(ServiceConfig.max_samplers_per_session) and it was the least recently used when another was "
                "created; create a new sampling client (save_weights_and_get_sampling_client), keep fewer "
                "sampling clients per session, or save the weights to a path (save_weights_for_sampler) so that "
                "they are reloaded after an eviction")
        restored = self.snapshots.restore(row)
        if restored is None:
            raise RuntimeError(
                f"sampling session {row.id} held an in-memory snapshot that is gone (server restarted or "
                "session evicted); create a new sampling client"
            )
        return restored

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
        live = self.sessions.by_id(sampler_id)
        if live is not None and live.owner == owner:
            path = live.model_path
        else:
            row = self.store.get(SamplerRow, sampler_id)
            path = row.model_path if row is not None and row.owner == owner else None  # else: _resolve's 404
        if path is not None:
            self.checkpoints.readable(owner, path)

    def _start_sample(self, sub: Submission, owner: str, sampler_id: str, num: Any, kwargs: dict[str, Any],
                      record: bool) -> None:
        if self.dispatcher.stopping:
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
        self.dispatcher.dispatch(sub, live, self.versions.version_for(live), kwargs, record,
                                 follow=self.versions.follower_for(live))

    def cancel(self, owner: str, request_id: str) -> bool:
        """`SampleDispatcher.cancel`: give up on `owner`'s running sample `request_id`."""
        return self.dispatcher.cancel(owner, request_id)

    # ------------------------------------------------------------------ a clean stop
    def snapshots_of(self, run_id: str, weights_token: str) -> list[str]:
        """`SessionTable.snapshots_of`: the loaded snapshot sessions holding those weights."""
        return self.sessions.snapshots_of(run_id, weights_token)

    def older_of(self, run_id: str, weights_token: str) -> dict[str, list[LiveSampler]]:
        """`SessionTable.older_of`: the loaded snapshot sessions holding older weights, by token."""
        return self.sessions.older_of(run_id, weights_token)

    def inflight_of(self, run_id: str) -> list[str]:
        """`SessionTable.inflight_of`: the loaded in-flight sessions following run `run_id`."""
        return self.sessions.inflight_of(run_id)

    def persist_snapshots(self, checkpoints: Any, run_id: str, owner: str, weights_token: str,
                          export: Callable[[Path], None]) -> int:
        """After a run's automatic save (on its lane: a clean stop's, or every
        `runs.autosave_every_steps`): when loaded snapshot sessions hold the run's current
        weights, or in-flight sessions follow the run, `export` writes the run's weights as
        its sampler checkpoint `ember-autosave` (a `CheckpointStore` automatic save:
        quota-exempt, replaced each time) with `SNAPSHOT_RECORD` naming those sessions, each
        of which comes back from it after the restart (`SnapshotSaves.restore`; an in-flight
        one then samples the run's weights at the stop, never older than its in-flight
        target, until the run's next in-flight save). Snapshot sessions of older weights are
        kept in subfolders of the same save when the sampler gives their tensors back
        (`ember.service.snapshot_store`). Bounded: one save per run, one folder per version a
        live session holds. How many sessions were kept (`SnapshotSaves.persist`)."""
        return self.snapshots.persist(checkpoints, run_id, owner, weights_token, export)

    def stop_taking(self) -> None:
        """A clean stop began: every new sample is refused (category server, `SAMPLE_STOPPING`)."""
        self.dispatcher.stop_taking()

    def drain(self, timeout_s: float) -> int:
        """`SampleDispatcher.drain`: let the running samples finish; how many failed at the bound."""
        return self.dispatcher.drain(timeout_s)

    def sleep_all(self) -> None:
        """Colocation: every sampler that shares the trainer's GPU releases it (backends
        without a sleep mode ignore this); each wakes on its next request."""
        self.backends.sleep_all()

    def drop_session(self, session_id: str) -> None:
        self.sessions.drop_session(session_id)
        self.versions.drop_session(session_id)

    def close(self) -> None:
        self.sessions.clear()
        self.versions.clear()
        self.backends.close()
        self.dispatcher.close()  # the samplers' last results are written
