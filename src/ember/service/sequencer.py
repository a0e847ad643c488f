"""Execution lanes and per-run seq_id ordering (docs/architecture.md contract 3).

* A `Lane` is one worker thread. Everything that touches one shared base model (all
  LoRA runs on it: creation, forward/backward, optimizer steps, saves, loads, snapshots)
  runs on that base model's lane, so peft's active-adapter switch and the engines' ops
  never interleave. A full fine-tuning run has a lane of its own. A lane shared by
  several owners (API keys) serves them round robin, first come first served within
  one owner (`ember.fairness.OwnerQueues`): a run releases one op at a time, so an owner
  with many busy runs holds many places in its own queue but one turn per rotation,
  and another owner's next op waits for at most one op of each other owner with work
  queued, plus the op already executing (docs/architecture.md, trust boundaries).
* A `RunSequencer` holds the requests of one training run and releases them to the lane
  strictly in `seq_id` order, one at a time. A missing seq_id is waited for at most
  `gap_timeout_s` — counted from the moment the run is idle with a later request
  waiting — and is then skipped with a logged warning. A request whose seq_id was
  skipped (or already executed) is handed to `on_late` instead of running.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ember.fairness import OwnerQueues

log = logging.getLogger(__name__)

Op = Callable[[], None]


class Lane:
    """A single worker thread executing submitted callables: round robin over owners,
    FIFO within one owner (a single owner's ops run in submission order)."""

    def __init__(self, name: str) -> None:
        self.name = name
        # The executor keeps its semantics (one thread, joined at interpreter exit, queued
        # work cancelled on close); each submit queues one "run the next fair op" task, so
        # the executor's FIFO only counts turns and `_waiting` decides whose turn it is.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ember-lane-{name}")
        self._waiting: OwnerQueues[tuple[str, Op]] = OwnerQueues(owner_of=lambda item: item[0])
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Op, owner: str = "") -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"lane {self.name!r} is closed")
            self._waiting.extend([(owner, fn)])
        self._pool.submit(self._next_turn)

    def _next_turn(self) -> None:
        with self._lock:
            if not self._waiting:
                return
            _, fn = self._waiting.head()
            self._waiting.next_turn(done=True)
        _guard(fn)

    def close(self, wait: bool = False) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=wait, cancel_futures=True)


def _guard(fn: Op) -> None:
    try:
        fn()
    except BaseException:  # noqa: BLE001 - ops report their own errors; this is a last resort
        log.exception("unhandled error in a lane task")


class RunSequencer:
    """Releases one run's requests in seq_id order, waiting a bounded time for gaps."""

    def __init__(self, run_id: str, lane: Lane, gap_timeout_s: float, next_seq: int = 1,
                 owner: str = "") -> None:
        self.run_id = run_id
        self.lane = lane
        self.owner = owner  # the lane's fair share: one turn per owner per rotation
        self.gap_timeout_s = gap_timeout_s
        self._next = next_seq
        self._pending: dict[int, tuple[Op, Callable[[str], None]]] = {}
        self._busy = False
        self._closed = False
        self._timer: threading.Timer | None = None
        self._on_drained: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self.skipped: list[int] = []

    @property
    def next_seq(self) -> int:
        return self._next

    @property
    def queued(self) -> int:
        """Requests waiting for their turn (not counting the one executing)."""
        with self._lock:
            return len(self._pending)

    def offer(self, seq_id: int, op: Op, on_late: Callable[[str], None]) -> None:
        """Queue `op` under `seq_id`. `on_late(reason)` is called instead if that seq_id's
        turn has passed (skipped after a gap timeout) or is already taken."""
        with self._lock:
            reason = None
            if self._closed:
                reason = f"training run {self.run_id} is closed"
            elif seq_id < self._next:
                reason = (
                    f"seq_id {seq_id} of {self.run_id} arrived after it was skipped (requests run in seq_id "
                    f"order; the next expected was {self._next})"
                )
            elif seq_id in self._pending:
                reason = f"seq_id {seq_id} of {self.run_id} was submitted twice with different requests"
            if reason is None:
                self._pending[seq_id] = (op, on_late)
                self._pump_locked()
        if reason is not None:
            on_late(reason)

    def _pump_locked(self) -> None:
        if self._busy or (self._closed and self._on_drained is None):
            return
        item = self._pending.pop(self._next, None)
        if item is not None:
            op = item[0]
            self._cancel_timer_locked()
            self._busy = True
            self.lane.submit(lambda: self._run(op), self.owner)
        elif self._pending and self._timer is None:
            expected = self._next
            self._timer = threading.Timer(self.gap_timeout_s, self._gap_expired, args=(expected,))
            self._timer.daemon = True
            self._timer.start()
        elif not self._pending and self._on_drained is not None:
            then, self._on_drained = self._on_drained, None
            self.lane.submit(then, self.owner)

    def _run(self, op: Op) -> None:
        try:
            op()
        finally:
            with self._lock:
                self._busy = False
                self._next += 1
                self._pump_locked()

    def _gap_expired(self, expected: int) -> None:
        with self._lock:
            self._timer = None
            if self._busy or self._next != expected or not self._pending or expected in self._pending:
                self._pump_locked()
                return
            first = min(self._pending)
            missing = list(range(expected, first))
            self.skipped.extend(missing)
            log.warning(
                "training run %s: seq_id(s) %s never arrived within %.1fs; skipping to seq_id %d",
                self.run_id, missing, self.gap_timeout_s, first,
            )
            self._next = first
            self._pump_locked()

    def _cancel_timer_locked(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def start_at(self, seq_id: int) -> None:
        """Number on from `seq_id` when nothing has run or waits yet: a run back from an
        automatic save made while it ran, whose client's requests after the save are lost."""
        with self._lock:
            if not self._busy and not self._pending and seq_id > self._next:
                self._next = seq_id

    def drain(self, then: Callable[[], None]) -> None:
        """Accept nothing new; run what is queued (gaps still time out), then `then()` on the lane."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._on_drained = then
            self._pump_locked()

    def close(self, reason: str) -> None:
        """Stop releasing; every request still queued gets `on_late(reason)`."""
        with self._lock:
            self._closed = True
            self._on_drained = None
            self._cancel_timer_locked()
            items, self._pending = list(self._pending.values()), {}
        for _, on_late in items:
            on_late(reason)
