"""Every future finishes (issue 16 item 2), whatever the database does.

A failing write of a future's result (injected OperationalError / ENOSPC, or a real
SQLite write lock held by another connection for longer than the retry) ends the future
as `server` within finish_retry_s + 2 x db_lock_timeout_s; its state is served from memory and
written once the database recovers; the next request succeeds. A create whose work cannot
be queued fails its recorded future. The sweep ends futures pending past the deadline and
rows no work holds.
"""

from __future__ import annotations

import sqlite3
import time

import pytest
from tinker import types

from ember import failpoints
from helpers.clock import ManualClock
from helpers.server import sft_datum, wait_until

from .conftest import lane_drained, new_run, result, wait

RETRY_S, LOCK_S = 0.6, 0.3
BOUND_S = RETRY_S + 2 * LOCK_S + 1.5  # the stated bound plus scheduling slack on a busy 2-core machine
DATA = [sft_datum([3, 5, 7, 9, 11])]
LEAKS = ("UPDATE", "INSERT", "SELECT", "[SQL", "sqlalche.me", "/", "Traceback")


@pytest.fixture(autouse=True)
def _disarm():
    failpoints.disarm()
    yield
    failpoints.disarm()


@pytest.fixture
def svc(make_service):
    return make_service(durability={"finish_retry_s": RETRY_S, "db_lock_timeout_s": LOCK_S},
                        housekeeping_interval_s=3600)


def _held_step(svc, owner, model_id, seq_id):
    """An optim_step held on the run's lane (fail point `run.op`, action `hold`) until
    `failpoints.release("run.op")`; returns once the op has started and is held."""
    failpoints.arm("run.op", "hold", times=1)
    sub = svc.optim_step(owner, model_id, seq_id, types.AdamParams(learning_rate=1e-3))
    wait_until(lambda: not failpoints.pending("run.op"), 30, interval=0.01, message="the op to reach its lane")
    return sub


def _orphan_row(svc, request_id: str, age_s: float, now: float | None = None) -> None:
    """A pending future row no work holds, as a server that died leaves it: written into
    the service's SQLite file from another connection, `age_s` before `now` (the service's clock)."""
    with sqlite3.connect(svc.config.data_dir / "ember.db") as db:
        db.execute("INSERT INTO futures (request_id, owner, request_type, status, created_at) "
                   "VALUES (?, 'alice', 'Sample', 'pending', ?)",
                   (request_id, (time.time() if now is None else now) - age_s))


def _assert_clean(message: str) -> None:
    assert not any(leak in message for leak in LEAKS), message


def _row(svc, sub):
    return svc.debug_state(futures=[sub.request_id]).futures[sub.request_id]


@pytest.mark.parametrize("action,cause", [("dblocked", "database error: database is locked"),
                                          ("enospc", "storage error: No space left on device")])
def test_a_result_that_cannot_be_stored_ends_as_server_and_the_next_request_succeeds(svc, action, cause):
    _, model_id = new_run(svc)
    failpoints.arm("futures.finish_write", action)
    start = time.monotonic()
    sub = svc.forward_backward("alice", model_id, 1, DATA, "cross_entropy")
    state = wait(svc, "alice", sub, timeout=BOUND_S + 10)
    elapsed = time.monotonic() - start
    assert state.status == "failed" and state.category == types.RequestErrorCategory.Server
    assert "could not be stored" in state.error and cause in state.error
    _assert_clean(state.error)
    assert elapsed < BOUND_S, f"ended after {elapsed:.2f}s, bound {BOUND_S}s"
    assert _row(svc, sub).status == "pending" and svc.debug_state().unsaved_futures == 1  # nothing could be written
    failpoints.disarm()
    assert svc.retrieve("alice", sub.request_id).status == "failed"  # served from memory meanwhile
    svc.housekeeping()  # the fault cleared: the final state is written
    assert svc.debug_state().unsaved_futures == 0
    row = _row(svc, sub)
    assert row.status == "failed" and row.category == "server" and cause in row.error
    out = result(svc, "alice", svc.forward_backward("alice", model_id, 2, DATA, "cross_entropy"))
    assert out.metrics["loss:sum"] > 0


def test_a_result_refused_for_itself_is_not_retried_and_its_failure_is_stored_at_once(svc):
    _, model_id = new_run(svc)
    failpoints.arm("futures.finish_write", "raise", times=1)  # not a transient fault: no retry
    sub = svc.forward_backward("alice", model_id, 1, DATA, "cross_entropy")
    state = wait(svc, "alice", sub, timeout=10)
    assert state.status == "failed" and state.category == types.RequestErrorCategory.Server
    assert "could not be stored (internal error (FailPointError)" in state.error
    assert svc.debug_state().unsaved_futures == 0 and _row(svc, sub).status == "failed"


def test_a_transient_fault_shorter_than_the_retry_is_invisible(svc):
    _, model_id = new_run(svc)
    failpoints.arm("futures.finish_write", "dblocked", times=2)
    sub = svc.forward_backward("alice", model_id, 1, DATA, "cross_entropy")
    assert result(svc, "alice", sub).metrics["loss:sum"] > 0
    assert _row(svc, sub).status == "complete"


def test_a_write_lock_held_longer_than_the_retry_ends_the_future_as_server(svc):
    _, model_id = new_run(svc)
    sub = _held_step(svc, "alice", model_id, 1)
    holder = sqlite3.connect(svc.config.data_dir / "ember.db", timeout=5)
    holder.execute("BEGIN IMMEDIATE")  # another process's writer: SQLite allows one
    try:
        start = time.monotonic()
        failpoints.release("run.op")
        state = wait(svc, "alice", sub, timeout=BOUND_S + 10)
        elapsed = time.monotonic() - start
        assert state.status == "failed" and state.category == types.RequestErrorCategory.Server
        assert "database is locked" in state.error, state.error
        _assert_clean(state.error)
        assert elapsed < BOUND_S, f"ended after {elapsed:.2f}s with the lock held, bound {BOUND_S}s"
    finally:
        holder.rollback()
        holder.close()
    out = result(svc, "alice", svc.forward_backward("alice", model_id, 2, DATA, "cross_entropy"))
    assert out.metrics["loss:sum"] > 0
    svc.housekeeping()
    assert _row(svc, sub).status == "failed"


@pytest.mark.slow
def test_a_create_whose_work_cannot_be_queued_fails_its_recorded_future(svc):
    sid, model_id = new_run(svc)
    failpoints.arm("futures.after_create", "raise", times=1)
    with pytest.raises(failpoints.FailPointError):
        svc.forward_backward("alice", model_id, 1, DATA, "cross_entropy")
    # The caller's retry (same run and seq_id: same dedup key) finds the finished future.
    again = svc.forward_backward("alice", model_id, 1, DATA, "cross_entropy")
    state = wait(svc, "alice", again, timeout=5)
    assert state.status == "failed" and state.category == types.RequestErrorCategory.Server
    assert "could not be queued" in state.error
    assert _row(svc, again).status == "failed"
    # seq_id 1 is spent (failed); the run goes on with the next one.
    assert result(svc, "alice", svc.forward_backward("alice", model_id, 2, DATA, "cross_entropy")).metrics


def test_the_sweep_ends_overdue_futures_and_orphaned_rows(make_service):
    clock = ManualClock()
    svc = make_service(durability={"future_deadline_s": 0.5, "orphan_grace_s": 0.5}, housekeeping_interval_s=3600,
                       clock=clock)
    _, model_id = new_run(svc)
    sub = _held_step(svc, "alice", model_id, 1)
    _orphan_row(svc, "req-orphan", age_s=5, now=clock())
    clock.advance(0.6)
    svc.housekeeping()
    state = svc.retrieve("alice", sub.request_id)
    assert state.status == "failed" and "did not finish within 0.5 s" in state.error
    orphaned = svc.retrieve("alice", "req-orphan")
    assert orphaned.status == "failed" and orphaned.category == types.RequestErrorCategory.Server
    failpoints.release("run.op")  # the op ends later: its result is ignored, the future stays failed
    lane_drained(svc, "alice", model_id)  # the released op has run to its end
    assert svc.retrieve("alice", sub.request_id).status == "failed"
    assert result(svc, "alice", svc.forward_backward("alice", model_id, 2, DATA, "cross_entropy")).metrics


def test_the_sweep_leaves_fresh_and_live_futures_alone(svc):
    _, model_id = new_run(svc)
    sub = _held_step(svc, "alice", model_id, 1)
    svc.housekeeping()  # default deadline (a day) and grace (a minute)
    assert svc.retrieve("alice", sub.request_id).status == "pending"
    failpoints.release("run.op")
    assert isinstance(result(svc, "alice", sub), types.OptimStepResponse)
