"""`LanePool`: which `Lane` a run executes on, and when a lane is closed.

Runs whose `EngineFactory.lane_key` is equal share one lane (e.g. every LoRA run of one
base model: one thread mutates the shared model). A lane counts the runs that may still
use it (live, or draining their last ops) and is closed when the last one is released.
"""

from __future__ import annotations

import threading

from ember.service.sequencer import Lane


class LanePool:
    def __init__(self) -> None:
        self._lanes: dict[str, Lane] = {}
        self._users: dict[str, int] = {}  # lane key -> runs that may still use the lane
        self._created = 0
        self._lock = threading.Lock()

    def acquire(self, key: str) -> Lane:
        """The lane of `key` (created on first use); counts one more user."""
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = Lane(f"{self._created}")
                self._created += 1
            self._users[key] = self._users.get(key, 0) + 1
            return lane

    def release(self, key: str) -> None:
        """One user of `key` is gone; the last one closes the lane (letting the task that
        calls this, on that lane, finish first). After `close`, nothing happens."""
        with self._lock:
            users = self._users.get(key, 0) - 1
            if users > 0:
                self._users[key] = users
                return
            self._users.pop(key, None)
            lane = self._lanes.pop(key, None)
        if lane is not None:
            lane.close(wait=False)

    def close(self) -> None:
        with self._lock:
            lanes, self._lanes, self._users = list(self._lanes.values()), {}, {}
        for lane in lanes:
            lane.close(wait=False)
