"""The periodic status line of `ember serve` (`[log]`, `--log.status_every_s`).

One INFO line every `status_every_s` on the logger `ember.status`:

    status: 3 runs, 2 sessions, 5 sampling sessions loaded; queued: lane 0 (Qwen/Qwen3-8B): 2 runs, 4 waiting;
    12 samples; 7 futures pending; 1234 trained tok/s, 5678 sampled tok/s (last 60 s)

What it reads is the service's `server_state()` (no per-key detail: the log is the
operator's) and the metrics' token counters (`ember.server.metrics`), whose growth over the
interval gives the rates. `status_line` is pure; `StatusReporter` is the thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("ember.status")


@dataclass
class LogConfig:
    """What `ember serve` logs beyond `--log-level` (`[log]`, `--log.*`).

    status_every_s: one status line (runs loaded, sessions, queue depth per training lane,
        samples queued, futures pending, trained and sampled tokens/s) every this many
        seconds; 0 = none.
    """

    status_every_s: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.status_every_s, bool) or not self.status_every_s >= 0:
            raise ValueError(f"log.status_every_s must be >= 0 seconds (0 = no status line), got "
                             f"{self.status_every_s!r}")


def status_line(state: Mapping[str, Any], tokens: Mapping[str, float], before: Mapping[str, float],
                seconds: float) -> str:
    """The line for `state` (`Service.server_state()`), with token rates from the counters
    `tokens` now and `before`, `seconds` apart."""
    lanes = "; ".join(f"{name}: {runs} runs, {waiting} waiting" for name, (runs, waiting) in state["lanes"].items())
    rates = {k: max(0.0, tokens[k] - before.get(k, 0.0)) / seconds if seconds > 0 else 0.0 for k in tokens}
    return (f"status: {state['runs']} runs, {state['sessions']} sessions, {state['samplers']} sampling sessions "
            f"loaded; queued: {lanes or 'no training lane'}; {state['samples_queued']} samples; "
            f"{state['futures_pending']} futures pending; {rates.get('trained_tokens', 0.0):.0f} trained tok/s, "
            f"{rates.get('sampled_tokens', 0.0):.0f} sampled tok/s (last {seconds:.0f} s)")


class StatusReporter:
    """Logs `status_line` every `every_s` seconds on a daemon thread until `stop()`."""

    def __init__(self, every_s: float, state: Callable[[], Mapping[str, Any]],
                 tokens: Callable[[], Mapping[str, float]]) -> None:
        self.every_s, self._state, self._tokens = every_s, state, tokens
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ember-status", daemon=True)

    def start(self) -> StatusReporter:
        if self.every_s > 0:
            self._thread.start()
        return self

    def _loop(self) -> None:
        before, then = self._tokens(), time.monotonic()
        while not self._stop.wait(self.every_s):
            try:
                tokens, now = self._tokens(), time.monotonic()
                log.info("%s", status_line(self._state(), tokens, before, now - then))
                before, then = tokens, now
            except Exception:  # noqa: BLE001 - a status line must never take the server down
                log.exception("status line failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
