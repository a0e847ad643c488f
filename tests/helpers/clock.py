"""A manual clock for `Service(clock=...)` and the managers that take one (`ember.service.clock`):
time moves when a test advances it, so a TTL of hours expires in no time and a TTL of seconds
never expires by accident on a slow host. Each read also moves it by `tick` (1 ms), as a real
clock would between two events, so that what the service stamps in turn (two saves, two
futures) keeps its order in listings; a test's TTLs are seconds, far above the ticks it reads."""

from __future__ import annotations

import threading


class ManualClock:
    """Wall-clock seconds that start at `start` (a plausible epoch time) and move by `advance`."""

    def __init__(self, start: float = 1_800_000_000.0, tick: float = 1e-3) -> None:
        self.now, self.tick = float(start), float(tick)
        self._lock = threading.Lock()  # the service reads it from many threads

    def __call__(self) -> float:
        with self._lock:
            self.now += self.tick
            return self.now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError(f"a clock goes forward only; got {seconds}")
        with self._lock:
            self.now += seconds
            return self.now
