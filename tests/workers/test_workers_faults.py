"""Faults never hang: a failing rank beside a blocked one, a hung call — each surfaces as an
error within a bounded time and stops every rank.

The kill -9 test (process and Ray runtimes, with rebuild and resume from the last
checkpoint) is the last test of tests/engine/test_engine_parallel.py, where it reuses the
warm groups of the exactness tests."""

import contextlib
import os
import time

import pytest

from ember.workers import WorkerError, WorkerGroup, WorkerTimeoutError
from helpers import ranks as wt
from helpers.server import wait_until

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

DETECT_S = 20.0  # generous bound for a loaded 2-core CI machine; detection itself is ~instant


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_all_dead(pids, timeout_s=15.0) -> list[int]:
    """The pids still alive once every one exited or `timeout_s` passed (the caller asserts on them)."""
    with contextlib.suppress(AssertionError):
        wait_until(lambda: not any(pid_alive(p) for p in pids), timeout_s, message="every rank to exit")
    return [p for p in pids if pid_alive(p)]


def make_group(runtime: str, **kwargs) -> WorkerGroup:
    return WorkerGroup.create(runtime, world_size=2, call_timeout_s=120, **kwargs)


def test_failing_rank_beside_a_blocked_rank_raises_its_error_and_stops_the_group():
    group = make_group("process", failure_grace_s=2.0)
    pids = group.pids()
    try:
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="refuses to join") as info:
            group.run(None, wt.block_in_collective_unless_rank, 1)
        assert time.monotonic() - t0 < 2.0 + DETECT_S
        assert "raised on rank 1" in "".join(getattr(info.value, "__notes__", []))
        assert group.broken
        with pytest.raises(WorkerError, match="broken"):
            group.ping()
    finally:
        group.shutdown()
    assert wait_all_dead(pids) == []


def test_hung_call_times_out_and_stops_every_rank():
    group = make_group("process")
    pids = group.pids()
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeoutError, match="no reply in time"):
            group.run(None, wt.sleep_then, 60.0, timeout_s=1.0)
        assert time.monotonic() - t0 < 1.0 + DETECT_S
        assert wait_all_dead(pids) == []  # stopped at once, not at shutdown
    finally:
        group.shutdown()
