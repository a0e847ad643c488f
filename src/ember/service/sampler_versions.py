"""Weight versions of sampling sessions: read from checkpoints, kept from memory syncs, followed in flight.

`SamplerVersions` turns a checkpoint path into a loaded `WeightVersion` (reading its files
through `CheckpointStore`, unless a memory sync already handed the same path's tensors
over), keeps one memory-synced version per run (`sync_saved`), and one in-flight target per
run (`kind="inflight"`: docs/architecture.md#in-flight-weights). Part of `SamplerManager`
(`service/samplers.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from tinker import types

from ember.sampling.follow import VersionFollower
from ember.service.api import UserError
from ember.service.checkpoint_store import CheckpointStore
from ember.service.model_registry import BaseModel, ModelRegistry
from ember.service.sampler_backends import BackendCache
from ember.service.store import RunRow, Store

# SamplerManager's logger (this module is part of it): operators filter every sampling line by one name
log = logging.getLogger("ember.service.samplers")


@dataclass
class InflightTarget:
    """A run's in-flight weights (`kind="inflight"`): the newest such save, which every
    in-flight sampling session of the run samples from (docs/architecture.md#in-flight-weights)."""

    session_id: str
    generation: int  # 1 for the run's first in-flight save, +1 for each later one
    version: Any
    follower: Any = None  # `ember.sampling.follow.VersionFollower`: mid-sequence adoption (one per run)


class SamplerVersions:
    """Versions loaded from checkpoints, the memory-synced ones, and each run's in-flight target."""

    def __init__(self, store: Store, registry: ModelRegistry, backends: BackendCache,
                 checkpoints: CheckpointStore) -> None:
        self.store, self.registry, self.backends, self.checkpoints = store, registry, backends, checkpoints
        self._lock = threading.Lock()
        # run_id -> (its session id, tinker path, base, version): `sync_saved`
        self._synced: dict[str, tuple[str, str, BaseModel, Any]] = {}
        self._inflight: dict[str, InflightTarget] = {}  # run_id -> its in-flight target

    # ------------------------------------------------------------------ memory-synced versions
    def sync_saved(self, run_id: str, path: str, base: BaseModel, weights: Iterable[tuple[str, torch.Tensor]],
                   lora: types.LoraConfig | None, session_id: str = "") -> None:
        """Memory mode: `save_weights_for_sampler(path)` also hands the run's tensors to the
        sampler, so sampling from `path` reads no file back. One such version per run is kept
        (the newest), and only while the run's session lasts and its checkpoint exists
        (`drop_session`, `release_synced`): sampling clients made from it hold the version
        themselves, as with files; after that, the path is read from its files as before."""
        version = self.backends.load(base, weights, lora)
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

    # ------------------------------------------------------------------ versions read from checkpoints
    def from_checkpoint(self, owner: str, path: str) -> tuple[BaseModel, Any]:
        tpath, crow = self.checkpoints.readable(owner, path)  # the owner's, or a published one
        synced = self._synced_version(tpath.uri)  # after the access check, never instead of it
        if synced is not None:
            return synced
        run = self.store.get(RunRow, crow.run_id)
        if run is None:
            raise UserError(f"checkpoint {path!r} has no training run record")
        base = self.registry.resolve(run.base_model)
        lora = types.LoraConfig(**run.lora_config) if run.lora_config else None
        if tpath.kind == "external":
            raise UserError(f"checkpoint {path!r} is an external-weights export (for download); sample from a "
                            "tinker://<run>/sampler_weights/<name> or tinker://<run>/weights/<name> path")
        if tpath.kind == "training":
            self._check_policy_head(path, crow)
        start = time.monotonic()  # the read counts: it is the files mode's cost
        weights = self.checkpoints.sampling_weights(crow)
        try:
            return base, self.backends.load(base, weights.items(), lora, mode="files", start=start)
        except UserError as exc:  # the backend refused the tensors: the checkpoint's content, not our fault
            raise UserError(f"checkpoint {path!r} cannot be sampled from: {exc}") from None

    def _check_policy_head(self, path: str, crow: Any) -> None:
        """A training checkpoint of a value head has no sampler (it outputs values, not tokens)."""
        head = self.checkpoints.saved_head(crow)  # None: unreadable metadata, reading the weights reports it
        if head is not None and head != "policy":
            raise UserError(f"checkpoint {path!r} holds a {head!r} head: it outputs values, not tokens, so a value "
                            "head has no sampler; load it into a training run (create_training_client_from_state) "
                            "and read its values with forward")

    # ------------------------------------------------------------------ in-flight targets
    def publish(self, run_id: str, session_id: str, version: Any) -> None:
        with self._lock:
            previous = self._inflight.get(run_id)
            generation = previous.generation + 1 if previous is not None else 1
            follower = previous.follower if previous is not None else VersionFollower(version, generation)
            if previous is not None:
                follower.publish(version)  # running followed sequences switch at their next decode step
            self._inflight[run_id] = InflightTarget(session_id, generation, version, follower)
        log.debug("run %s: in-flight weights generation %d published", run_id, generation)

    def inflight_generations(self) -> dict[str, int]:
        """Run id -> how many in-flight saves it has published (`SamplerManager.debug_state`)."""
        with self._lock:
            return {run_id: target.generation for run_id, target in self._inflight.items()}

    def follower_for(self, live: Any) -> Any:
        """An in-flight session's run follower (`VersionFollower`), None for any other session:
        a backend that adopts versions mid-sequence (`Sampler.follows_mid_sequence`) gets it
        with the request (`SampleDispatcher.dispatch`)."""
        if live.follows is None:
            return None
        with self._lock:
            target = self._inflight.get(live.follows)
        return target.follower if target is not None else None

    def version_for(self, live: Any) -> Any:
        """The weights a new request of `live` (a `LiveSampler`) samples from: its own
        snapshot, or for an in-flight session the run's newest in-flight target (kept to the
        end of the request unless the backend follows mid-sequence: `follower_for`)."""
        if live.follows is None:
            return live.version
        with self._lock:
            target = self._inflight.get(live.follows)
        return target.version if target is not None else live.version

    # ------------------------------------------------------------------ lifetime
    def drop_session(self, session_id: str) -> None:
        with self._lock:
            for run_id in [r for r, entry in self._synced.items() if entry[0] == session_id]:
                del self._synced[run_id]  # its runs are unloaded: their saved paths read files again
            for run_id in [r for r, target in self._inflight.items() if target.session_id == session_id]:
                del self._inflight[run_id]

    def clear(self) -> None:
        with self._lock:
            self._synced.clear()
            self._inflight.clear()
