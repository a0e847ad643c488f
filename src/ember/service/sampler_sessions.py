"""The table of loaded sampling sessions, bounded per client session by evicting the least recently used.

At most `max_per_session` sampling sessions per client session stay loaded; the least
recently used is evicted (and reloaded on use when it has a model path), so a sampler used
every step, such as a KL reference, stays loaded. Evicted snapshot ids are remembered
(bounded) to tell an eviction from a restart. Part of `SamplerManager` (`service/samplers.py`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ember.service.model_registry import BaseModel

# SamplerManager's logger (this module is part of it): operators filter every sampling line by one name
log = logging.getLogger("ember.service.samplers")

_EVICTED_KEPT = 65536  # evicted snapshot ids remembered, to tell an eviction from a restart


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


class SessionTable:
    """Loaded sampling sessions by client session (LRU order) and by id."""

    def __init__(self, max_per_session: int) -> None:
        self.max_per_session = max_per_session
        self._live: dict[str, OrderedDict[str, LiveSampler]] = {}  # session_id -> sampler_id -> live
        self._by_id: dict[str, LiveSampler] = {}  # sampler_id -> live, for every loaded session
        self._evicted: OrderedDict[str, None] = OrderedDict()  # snapshot sampler ids evicted (bounded)
        self._lock = threading.Lock()

    def remember(self, live: LiveSampler) -> None:
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

    def used(self, owner: str, sampler_id: str) -> LiveSampler | None:
        """`owner`'s loaded session `sampler_id`, marked most recently used; None when not loaded."""
        with self._lock:  # a loaded session needs no database read (its row is immutable)
            live = self._by_id.get(sampler_id)
            if live is not None and live.owner == owner:
                self._live[live.session_id].move_to_end(sampler_id)  # eviction takes the least recently used
                return live
        return None

    def in_session(self, session_id: str, sampler_id: str) -> LiveSampler | None:
        with self._lock:
            return self._live.get(session_id, {}).get(sampler_id)

    def by_id(self, sampler_id: str) -> LiveSampler | None:
        with self._lock:
            return self._by_id.get(sampler_id)

    def was_evicted(self, sampler_id: str) -> bool:
        with self._lock:
            return sampler_id in self._evicted

    def loaded_total(self) -> int:
        """Sampling sessions loaded now, over every owner."""
        with self._lock:
            return len(self._by_id)

    def loaded_count(self, owner: str) -> int:
        """Sampling sessions of `owner` loaded now (`limits.max_sampling_sessions_per_key`)."""
        with self._lock:
            return sum(1 for live in self._by_id.values() if live.owner == owner)

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

    def drop_session(self, session_id: str) -> None:
        with self._lock:
            for sampler_id in self._live.pop(session_id, {}):
                self._by_id.pop(sampler_id, None)

    def clear(self) -> None:
        with self._lock:
            self._live.clear()
            self._by_id.clear()
