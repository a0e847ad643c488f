"""RunSequencer: seq_id order with out-of-order arrival, bounded gap wait, late arrivals."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from ember.service.sequencer import Lane, RunSequencer


@pytest.fixture
def lane():
    lane = Lane("test")
    yield lane
    lane.close(wait=True)


def _recorder():
    done, lock, finished = [], threading.Lock(), threading.Event()

    def op(tag, total):
        def run():
            with lock:
                done.append(tag)
                if len(done) == total:
                    finished.set()
        return run

    return done, op, finished


def test_out_of_order_arrival_executes_in_seq_order(lane):
    seq = RunSequencer("run", lane, gap_timeout_s=10.0, next_seq=1)
    done, op, finished = _recorder()
    late = []
    for s in (3, 5, 2, 4, 1):  # the SDK's parallel chunks send chunk 1 last
        seq.offer(s, op(s, 5), late.append)
    assert finished.wait(5)
    assert done == [1, 2, 3, 4, 5]
    assert late == [] and seq.skipped == [] and seq.next_seq == 6


def test_missing_seq_id_is_skipped_after_the_gap_timeout(lane, caplog):
    seq = RunSequencer("run", lane, gap_timeout_s=0.3, next_seq=1)
    done, op, finished = _recorder()
    late = []
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="ember.service.sequencer"):
        seq.offer(2, op(2, 2), late.append)  # seq 1 never arrives (rejected at HTTP level)
        seq.offer(3, op(3, 2), late.append)
        assert finished.wait(5)
    waited = time.monotonic() - t0
    assert done == [2, 3]
    assert 0.25 <= waited < 3.0, waited
    assert seq.skipped == [1]
    assert any("never arrived" in r.getMessage() for r in caplog.records)
    # The skipped seq_id arriving afterwards must not run; it is reported instead.
    seq.offer(1, op("late", 99), late.append)
    ran = threading.Event()  # a marker after whatever the offer queued on the lane: that has run by now
    lane.submit(ran.set, seq.owner)
    assert ran.wait(5)
    assert done == [2, 3]
    assert len(late) == 1 and "arrived after it was skipped" in late[0]


def test_gap_timer_is_not_started_while_the_run_is_busy(lane):
    """The wait for a gap counts from when the run is idle, not from arrival."""
    seq = RunSequencer("run", lane, gap_timeout_s=0.2, next_seq=1)
    release = threading.Event()
    done, op, finished = _recorder()
    seq.offer(1, lambda: (release.wait(5), done.append(1)), lambda r: None)
    seq.offer(3, op(3, 3), lambda r: None)  # 2 is missing while 1 runs for 0.5 s
    time.sleep(0.5)
    seq.offer(2, op(2, 3), lambda r: None)  # arrives before 1 finished: not skipped
    release.set()
    assert finished.wait(5)
    assert done == [1, 2, 3] and seq.skipped == []


def test_duplicate_pending_seq_and_close(lane):
    seq = RunSequencer("run", lane, gap_timeout_s=10.0, next_seq=1)
    late = []
    seq.offer(2, lambda: None, late.append)
    seq.offer(2, lambda: None, late.append)
    assert len(late) == 1 and "submitted twice" in late[0]
    seq.close("shutting down")
    assert late[-1] == "shutting down"
    seq.offer(1, lambda: None, late.append)
    assert "closed" in late[-1]


def _gated(lane):
    """Occupy `lane` until the returned event is set (owner "gate")."""
    gate, started = threading.Event(), threading.Event()
    lane.submit(lambda: (started.set(), gate.wait(10)), "gate")
    assert started.wait(5)
    return gate


def test_lane_serves_owners_round_robin_and_one_owner_in_order(lane):
    gate = _gated(lane)
    done, op, finished = _recorder()
    for i in range(5):
        lane.submit(op(f"a{i}", 8), "alice")
    lane.submit(op("b0", 8), "bob")
    lane.submit(op("b1", 8), "bob")
    lane.submit(op("c0", 8), "carol")
    gate.set()
    assert finished.wait(5)
    # one turn per owner per rotation; alice's own ops keep their order
    assert done == ["a0", "b0", "c0", "a1", "b1", "a2", "a3", "a4"]


def test_an_owner_with_many_runs_gets_one_turn_per_rotation(lane):
    """Each run releases one op at a time; four busy runs of one owner still delay
    another owner's op by at most one op, not by one op per run."""
    gate = _gated(lane)
    done, op, finished = _recorder()
    runs = [RunSequencer(f"a{r}", lane, gap_timeout_s=10.0, next_seq=1, owner="alice") for r in range(4)]
    for s in (1, 2, 3):
        for r, seq in enumerate(runs):
            seq.offer(s, op(f"a{r}.{s}", 13), lambda reason: None)
    RunSequencer("b", lane, gap_timeout_s=10.0, next_seq=1, owner="bob").offer(1, op("b.1", 13), lambda r: None)
    gate.set()
    assert finished.wait(10)
    assert done.index("b.1") == 1
    for r in range(4):  # every run still runs in seq_id order
        mine = [tag for tag in done if tag.startswith(f"a{r}.")]
        assert mine == [f"a{r}.1", f"a{r}.2", f"a{r}.3"]


def test_closed_lane_refuses_and_drops_what_waits():
    lane = Lane("closing")
    gate = _gated(lane)
    ran = []
    lane.submit(lambda: ran.append("queued"), "alice")
    lane.close(wait=False)
    gate.set()
    with pytest.raises(RuntimeError, match="closed"):
        lane.submit(lambda: None, "alice")
    lane.close(wait=True)
    assert ran == []
