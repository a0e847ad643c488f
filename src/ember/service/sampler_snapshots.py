"""Snapshot sampling sessions across a clean stop: saved with their run's weights, back after the restart.

A snapshot session (`save_weights_and_get_sampling_client`) keeps its weights in memory
only; each automatic save of its run (a clean stop's, or every `runs.autosave_every_steps`)
writes those that hold the run's current weights to disk (`persist`: the run's sampler
checkpoint `ember-autosave` and the ids of the sessions it serves), and those that hold
older weights into subfolders of that save when the sampler gives their tensors back
(`service/snapshot_store.py`); they come back lazily (`restore`), with the run's in-flight
sessions (`kind="inflight"`, then sampling those saved weights). Every save goes through
`CheckpointStore`; a subfolder named by the record is read only after
`snapshot_store.older_dir` checked it.
Part of `SamplerManager` (`service/samplers.py`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinker import types

from ember.service.checkpoint_store import AUTOSAVE_NAME, CheckpointStore
from ember.service.faults import public_message
from ember.service.model_registry import ModelRegistry
from ember.service.sampler_backends import BackendCache
from ember.service.sampler_sessions import LiveSampler, SessionTable
from ember.service.snapshot_store import OlderEntry, OlderVersion, older_dir, parse_older, write_older
from ember.service.store import RunRow, SamplerRow, Store

# SamplerManager's logger (this module is part of it): operators filter every sampling line by one name
log = logging.getLogger("ember.service.samplers")

# Beside a run's snapshot save (`persist_snapshots`): the run's weights token, the ids of
# the sampling sessions whose snapshot those weights are, and the older versions' subfolders.
SNAPSHOT_RECORD = "ember-snapshots.json"


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


def parse_snapshot_record(text: str | None) -> SnapshotRecord | None:
    """A snapshot save's `SNAPSHOT_RECORD` from its text; None if absent or malformed."""
    if text is None:
        return None
    try:
        record = json.loads(text)
        ids, inflight = record["sampling_sessions"], record.get("inflight_sessions", [])
        if not isinstance(record["weights"], str) or not all(isinstance(i, str) for i in [*ids, *inflight]):
            return None
        older = parse_older(record.get("older_sessions", {}))
        return SnapshotRecord(record["weights"], frozenset(ids), frozenset(inflight), older)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


class SnapshotSaves:
    """Writes a run's snapshot save after its automatic saves and brings its sessions back from it."""

    def __init__(self, store: Store, registry: ModelRegistry, backends: BackendCache, sessions: SessionTable,
                 checkpoints: CheckpointStore) -> None:
        self.store, self.registry, self.backends = store, registry, backends
        self.sessions, self.checkpoints = sessions, checkpoints

    def persist(self, checkpoints: Any, run_id: str, owner: str, weights_token: str,
                export: Callable[[Path], None]) -> int:
        """`SamplerManager.persist_snapshots`: how many sessions were kept."""
        ids, inflight = self.sessions.snapshots_of(run_id, weights_token), self.sessions.inflight_of(run_id)
        older = self.sessions.older_of(run_id, weights_token)
        if not ids and not inflight and not older:
            return 0
        previous = self.checkpoints.row(snapshot_path(run_id))
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
        sampler, version = self.backends.backend(live.base), live.version
        return OlderVersion(live.weights, lambda: sampler.version_weights(version),
                            version.lora_rank if version.is_lora else None, live.base.name)

    def restore(self, row: SamplerRow) -> LiveSampler | None:
        """A snapshot session back after a restart, from its run's snapshot save
        (`persist`); None when that save does not hold it."""
        crow = self.checkpoints.row(snapshot_path(row.source_run_id))
        record = parse_snapshot_record(self.checkpoints.read_extra(crow, SNAPSHOT_RECORD)) if crow is not None else None
        if record is None or row.id not in record.snapshots | record.inflight | record.older.keys():
            return None
        folder, token = None, record.weights
        if row.id in record.older:  # a snapshot of older weights: their own subfolder
            entry = record.older[row.id]
            try:
                folder, token = older_dir(Path(crow.directory), entry.folder), entry.weights
            except ValueError as exc:
                log.error("sampling session %s not restored: %s names a folder outside the run's automatic save "
                          "(%s); refused", row.id, SNAPSHOT_RECORD, exc)
                return None
        run = self.store.get(RunRow, row.source_run_id)
        base = self.registry.resolve(row.base_model)
        lora = types.LoraConfig(**run.lora_config) if run is not None and run.lora_config else None
        start = time.monotonic()
        weights = self.checkpoints.sampling_weights(crow, folder)
        version = self.backends.load(base, weights.items(), lora, mode="files", start=start)
        follows = row.source_run_id if row.id in record.inflight else None  # a later in-flight save: followed
        live = LiveSampler(row.id, row.owner, row.session_id, base, version, follows=follows,
                           source_run=row.source_run_id, weights=token)
        self.sessions.remember(live)
        log.debug("sampling session %s back from %s", row.id, crow.tinker_path)
        return live
