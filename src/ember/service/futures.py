"""Futures: request_id → pending | complete(result) | failed(error, category).

Every future is a database row (written before its work is queued, updated with the
pickled result before anyone is told), plus an in-memory entry while it is live so that
waiters (`retrieve` long-polls, asyncio servers, the in-process client) are woken
without polling. Finished entries stay in a bounded in-memory cache; older ones are
read back from the database.

Every future reaches an end (docs/architecture.md contract 6), whatever the database does:
- finishing is one UPDATE, retried for `finish_retry_s` while the fault is transient
  (locked, disk full, connection lost); a result that still cannot be stored ends the
  future as a `server` failure saying so, and a final state that cannot be written at
  all is kept in memory (served to clients) and written by `sweep` once the database
  recovers;
- a create call whose work cannot be queued after its row was recorded fails that
  future (`accepting`), so a retry of the call finds it finished;
- `sweep` (housekeeping) ends futures pending past a deadline, and pending rows that no
  work of this lifetime will ever finish.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tinker import types

from ember import failpoints
from ember.service.api import FutureState, NotFoundError, RequestType, Submission, UserError
from ember.service.clock import SYSTEM_CLOCK, Clock
from ember.service.faults import is_transient, public_message
from ember.service.store import FutureRow, Store, dump_payload, load_payload

log = logging.getLogger(__name__)

User = types.RequestErrorCategory.User
Server = types.RequestErrorCategory.Server


@dataclass
class _Entry:
    owner: str
    state: FutureState
    event: threading.Event = field(default_factory=threading.Event)
    callbacks: list[Callable[[FutureState], None]] = field(default_factory=list)
    finishing: bool = False
    created: float = 0.0  # the table's clock when it was accepted (the pending deadline counts from it)
    session: str | None = None  # the client session whose request this is (idle expiry)


ORPHAN_MESSAGE = ("this request was recorded but no work of the running server will finish it "
                  "(its submission failed part-way); resubmit it")


class FutureTable:
    """Creates, finishes and serves futures. Thread-safe."""

    def __init__(self, store: Store, cache_size: int = 4096, finish_retry_s: float = 10.0,
                 check_result_size: Callable[[int], None] | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        self._store = store
        self._clock = clock  # created/finished times, the pending deadline, orphaned rows (ember.service.clock)
        # Raises UserError for a stored result over its bound (`Limits.check_result_size`).
        self._check_result_size = check_result_size
        self._finish_retry_s = finish_retry_s
        # Final states whose row could not be written yet: served from here, written by sweep().
        self._unsaved: dict[str, tuple[_Entry, dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._create_lock = threading.Lock()
        self._live: dict[str, _Entry] = {}
        self._done: OrderedDict[str, _Entry] = OrderedDict()
        # dedup key -> (owner, submission): a bounded fast path; the database's unique key is the truth.
        self._keys: OrderedDict[str, tuple[str, Submission]] = OrderedDict()
        self._cache_size = cache_size
        # Observers of every finished future (metrics): called on the finishing thread.
        self._listeners: list[Callable[[FutureState], None]] = []
        # Told the session of every finished future that has one (its last activity).
        self.on_session_activity: Callable[[str], None] | None = None

    def add_listener(self, fn: Callable[[FutureState], None]) -> None:
        """Call `fn(final_state)` after every future finishes (complete or failed). Lets
        the server count completions without the service knowing about metrics."""
        self._listeners.append(fn)

    # ------------------------------------------------------------------ creation
    def create(
        self,
        owner: str,
        request_type: RequestType,
        *,
        model_id: str | None = None,
        dedup_key: str | None = None,
        num_sequences: int | None = None,
        session: str | None = None,
    ) -> tuple[Submission, bool]:
        """A new pending future, or the existing one for `dedup_key`. Returns (submission, created).

        The row is committed before this returns: an accepted request survives a crash.
        `session`: the client session the request belongs to (kept in memory only: a
        session with a pending future is never idle).
        """
        with self._create_lock:  # not self._lock: workers finishing futures must not wait on this insert
            if dedup_key is not None:
                known = self._keys.get(dedup_key)
                if known is not None and known[0] == owner:
                    return known[1], False
            rid = f"req-{uuid.uuid4().hex}"
            seq_ids = [f"{rid}:{i}" for i in range(num_sequences)] if num_sequences is not None else None
            row = dict(request_id=rid, owner=owner, request_type=request_type, model_id=model_id, dedup_key=dedup_key,
                       sample_sequence_ids=seq_ids, status="pending", created_at=self._clock())
            if not self._store.insert_future(row):  # the key exists from an earlier lifetime (or another owner)
                existing = self._store.future_by_key(dedup_key)
                if existing is not None and existing.owner == owner:
                    sub = _submission(existing)
                    self._keys[dedup_key] = (owner, sub)
                    return sub, False
                row["dedup_key"] = f"{dedup_key}#{uuid.uuid4().hex}"  # never alias another owner's key
                self._store.insert_future(row)
            sub = Submission(request_id=rid, model_id=model_id, sample_sequence_ids=seq_ids)
            if dedup_key is not None:
                self._keys[dedup_key] = (owner, sub)
                while len(self._keys) > 16 * self._cache_size:
                    self._keys.popitem(last=False)
        state = FutureState(request_id=rid, request_type=request_type, status="pending", model_id=model_id)
        with self._lock:
            self._live[rid] = _Entry(owner=owner, state=state, session=session, created=self._clock())
        return sub, True

    def tag_session(self, request_id: str, session: str) -> None:
        """Count a pending future as work of `session` (when its creator could not say)."""
        with self._lock:
            entry = self._live.get(request_id)
            if entry is not None:
                entry.session = session

    def pending_sessions(self) -> set[str]:
        """Sessions with a future still pending (busy: not idle, whatever their last request)."""
        with self._lock:
            return {e.session for e in self._live.values() if e.session is not None}

    # ------------------------------------------------------------------ completion
    def complete(self, request_id: str, result: Any) -> None:
        try:
            blob = dump_payload(result)
        except Exception as exc:  # noqa: BLE001 - an unpicklable result is our bug
            log.exception("cannot serialise the result of %s", request_id)
            self.fail(request_id, "the result of this request could not be stored "
                                  f"(not serialisable: {type(exc).__name__})", Server)
            return
        try:  # before the row is written: a 268 MB result must not be kept for days
            if self._check_result_size is not None:
                self._check_result_size(len(blob))
        except UserError as exc:
            self.fail(request_id, str(exc), User)
            return
        self._finish(request_id, "complete", result=result, payload=blob)

    def fail(self, request_id: str, error: str, category: types.RequestErrorCategory, *,
             retry_s: float | None = None) -> None:
        self._finish(request_id, "failed", error=error, category=category, retry_s=retry_s)

    def _finish(self, request_id: str, status: str, *, result=None, payload=None, error=None, category=None,
                retry_s: float | None = None) -> None:
        with self._lock:
            entry = self._live.get(request_id)
            if entry is None or entry.finishing:
                log.debug("future %s already finished; %s ignored", request_id, status)
                return
            entry.finishing = True
        if category == Server:  # the operator's to look at (user errors are the caller's)
            log.warning("request %s (%s) failed (server): %s", request_id, entry.state.request_type, error)
        values = dict(status=status, payload=payload, error=error,
                      category=None if category is None else str(category), finished_at=self._clock())
        # The row is committed before anyone can observe the result (survives a crash).
        saved, values = self._store_final(request_id, values, self._finish_retry_s if retry_s is None else retry_s)
        s = entry.state
        final = FutureState(
            request_id=s.request_id, request_type=s.request_type, status=values["status"],  # type: ignore[arg-type]
            result=result if values["status"] == "complete" else None, error=values["error"],
            category=None if values["category"] is None else types.RequestErrorCategory(values["category"]),
            model_id=s.model_id,
        )
        self._publish(request_id, entry, final, None if saved else values)

    def _store_final(self, request_id: str, values: dict[str, Any], retry_s: float) -> tuple[bool, dict[str, Any]]:
        """Write the final row (retrying transient faults for `retry_s`). A result that cannot
        be stored becomes a `server` failure saying why. Returns (written, the values to serve)."""
        try:
            self._write_final(request_id, values, retry_s)
            return True, values
        except Exception as exc:  # noqa: BLE001 - every future must end, whatever the store does
            log.error("future %s: its %s state could not be stored", request_id, values["status"], exc_info=exc)
            transient, why = is_transient(exc), public_message(exc)
        if values["status"] == "complete":
            values = dict(values, status="failed", payload=None, category=str(Server),
                          error=f"the result of this request could not be stored ({why}); resubmit it")
        if transient:  # the database is still failing: sweep() writes the failure, no wait here
            return False, values
        try:  # the payload itself was refused: the smaller failure row may well go in
            self._write_final(request_id, values, 0.0)
            return True, values
        except Exception:  # noqa: BLE001 - kept in memory; sweep() writes it later
            return False, values

    def _write_final(self, request_id: str, values: dict[str, Any], retry_s: float) -> None:
        deadline, delay = time.monotonic() + retry_s, 0.05
        while True:
            try:
                failpoints.hit("futures.finish_write")
                self._store.update(FutureRow, request_id, **values)
                return
            except Exception as exc:
                if not is_transient(exc) or time.monotonic() + delay > deadline:
                    raise
                log.warning("finishing future %s: %s; retrying", request_id, public_message(exc))
                time.sleep(delay)
                delay = min(2 * delay, 1.0)

    def _publish(self, request_id: str, entry: _Entry, final: FutureState, unsaved: dict[str, Any] | None) -> None:
        if entry.session is not None and self.on_session_activity is not None:
            self.on_session_activity(entry.session)  # before anyone sees it: no idle gap in between
        with self._lock:
            entry.state = final
            self._live.pop(request_id, None)
            self._done[request_id] = entry
            if unsaved is not None:
                self._unsaved[request_id] = (entry, unsaved)
            while len(self._done) > self._cache_size:
                self._done.popitem(last=False)
            callbacks, entry.callbacks = entry.callbacks, []
        entry.event.set()
        for cb in [*callbacks, *self._listeners]:
            try:
                cb(final)
            except Exception:  # noqa: BLE001 - a waiter's bug must not break the worker
                log.exception("future callback failed for %s", request_id)

    @contextmanager
    def accepting(self, request_id: str) -> Iterator[None]:
        """Wrap what follows a create (queueing the work): if it raises, the recorded future
        fails (`server`) before the error propagates, so the caller's retry (same dedup key)
        finds a finished future instead of one nothing will ever finish."""
        try:
            failpoints.hit("futures.after_create")
            yield
        except BaseException as exc:
            log.exception("request %s was recorded but its work could not be queued", request_id)
            self.fail(request_id, f"the request was recorded but could not be queued: {public_message(exc)}", Server)
            raise

    # ------------------------------------------------------------------ sweep
    def sweep(self, deadline_s: float | None, orphan_grace_s: float) -> int:
        """Housekeeping: write final states kept in memory, end live futures pending past
        `deadline_s`, and pending rows older than `orphan_grace_s` that no work of this
        lifetime holds. Returns how many futures it ended."""
        self._flush_unsaved()
        ended = 0
        if deadline_s is not None:
            for rid in self._overdue(deadline_s):
                self.fail(rid, f"this request did not finish within {deadline_s:g} s of being accepted; "
                               "the server ended it (resubmit it)", Server)
                ended += 1
        for rid in self._store.pending_future_ids(self._clock() - orphan_grace_s):
            with self._lock:
                held = rid in self._live or rid in self._unsaved
            if not held and self._store.fail_future_if_pending(rid, ORPHAN_MESSAGE, self._clock()):
                log.warning("future %s was pending with no work behind it; ended", rid)
                ended += 1
        return ended

    def _overdue(self, deadline_s: float) -> list[str]:
        cutoff = self._clock() - deadline_s
        with self._lock:
            return [rid for rid, e in self._live.items() if e.created < cutoff and not e.finishing]

    def _flush_unsaved(self) -> None:
        with self._lock:
            pending = list(self._unsaved.items())
        for rid, (_, values) in pending:
            try:
                self._write_final(rid, values, 0.0)
            except Exception as exc:  # noqa: BLE001 - still failing: try again next sweep
                log.warning("future %s: final state still not stored (%s)", rid, public_message(exc))
                continue
            with self._lock:
                self._unsaved.pop(rid, None)

    def unsaved_count(self) -> int:
        with self._lock:
            return len(self._unsaved)

    # ------------------------------------------------------------------ access
    def _entry(self, owner: str, request_id: str) -> _Entry | None:
        with self._lock:
            entry = self._live.get(request_id) or self._done.get(request_id)
            if entry is None and request_id in self._unsaved:
                entry = self._unsaved[request_id][0]
        if entry is not None and entry.owner != owner:
            raise NotFoundError(f"unknown request_id {request_id!r}")
        return entry

    def _from_db(self, owner: str, request_id: str) -> FutureState:
        row = self._store.get(FutureRow, request_id)
        if row is None or row.owner != owner:
            raise NotFoundError(f"unknown request_id {request_id!r}")
        return _state_from_row(row)

    def get(self, owner: str, request_id: str, timeout_s: float = 0.0) -> FutureState:
        entry = self._entry(owner, request_id)
        if entry is None:
            return self._from_db(owner, request_id)
        if timeout_s > 0 and not entry.state.done:
            entry.event.wait(timeout_s)
        return entry.state

    def watch(self, owner: str, request_id: str) -> concurrent.futures.Future:
        """A concurrent Future that resolves with the final FutureState."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        entry = self._entry(owner, request_id)
        if entry is None:
            fut.set_result(self._from_db(owner, request_id))
            return fut
        with self._lock:
            if not entry.state.done:
                entry.callbacks.append(fut.set_result)
                return fut
        fut.set_result(entry.state)
        return fut

    async def get_async(self, owner: str, request_id: str, timeout_s: float = 0.0) -> FutureState:
        cf = self.watch(owner, request_id)
        if not cf.done() and timeout_s > 0:
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(cf)), timeout_s)
            except (asyncio.TimeoutError, TimeoutError):
                pass
        if cf.done():
            return cf.result()
        return self.get(owner, request_id, 0.0)

    def pending_count(self) -> int:
        """Futures of this server lifetime not finished yet (O(1), no database)."""
        with self._lock:
            return len(self._live)

    def pending_count_of(self, owner: str) -> int:
        """`owner`'s futures of this lifetime not finished yet (the console's server state)."""
        with self._lock:
            return sum(1 for e in self._live.values() if e.owner == owner)

    def owner_of(self, request_id: str) -> str | None:
        """The owner of a future of this lifetime (a completion listener's per-key usage)."""
        with self._lock:
            entry = self._live.get(request_id) or self._done.get(request_id)
        return None if entry is None else entry.owner

    def pending_ids(self) -> list[str]:
        with self._lock:
            return list(self._live)

    def fail_all_pending(self, message: str) -> None:
        """Shutdown: every future still pending fails (server), so no waiter hangs. No
        retries: a row left pending is failed by the next start-up anyway."""
        for rid in self.pending_ids():
            self.fail(rid, message, Server, retry_s=0.0)


def _submission(row: FutureRow) -> Submission:
    return Submission(request_id=row.request_id, model_id=row.model_id, sample_sequence_ids=row.sample_sequence_ids)


def _state_from_row(row: FutureRow) -> FutureState:
    base = dict(request_id=row.request_id, request_type=row.request_type, model_id=row.model_id)
    if row.status == "pending":
        return FutureState(status="pending", **base)
    if row.status == "failed":
        return FutureState(status="failed", error=row.error, category=types.RequestErrorCategory(row.category), **base)
    try:
        result = load_payload(row.payload)
    except Exception as exc:  # noqa: BLE001
        return FutureState(status="failed", error=f"stored result cannot be read back: {exc}", category=Server, **base)
    return FutureState(status="complete", result=result, **base)
