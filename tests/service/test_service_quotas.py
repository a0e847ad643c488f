"""Idle session expiry and out-of-memory messages in the service (issue 24, item 5); the
quotas themselves are tested against `ember serve` in tests/server/test_server_quotas.py."""

from __future__ import annotations

import pytest
import torch
from tinker import types

from ember.service import SessionGoneError
from helpers.clock import ManualClock
from ember.service.faults import public_message

from .conftest import new_run, wait

ADAM = types.AdamParams(learning_rate=1e-3)


def test_an_idle_session_ends_but_one_with_pending_work_does_not(make_service):
    clock = ManualClock()  # the sessions' idleness runs on it: 0.5 s of its time, however slow the host
    svc = make_service(sessions={"idle_ttl_s": 0.5}, seq_gap_timeout_s=30.0, clock=clock)
    idle_sid, idle_run = new_run(svc)  # alice's last request
    busy_sid, busy_run = new_run(svc, owner="bob")
    pending = svc.optim_step("bob", busy_run, 2, ADAM)  # waits for seq_id 1: pending work
    clock.advance(0.3)  # under the TTL: still there
    svc.heartbeat("alice", idle_sid)
    svc.expire_sessions()
    svc.heartbeat("alice", idle_sid)
    clock.advance(0.3)  # over it, with heartbeats in between: heartbeats alone do not keep a session
    with pytest.raises(SessionGoneError, match="idle for more than 0.5 s"):
        svc.heartbeat("alice", idle_sid)
        svc.expire_sessions()  # [] when the housekeeping thread was first
        svc.heartbeat("alice", idle_sid)
    assert "not loaded" in wait(svc, "alice", svc.optim_step("alice", idle_run, 1, ADAM)).error
    svc.heartbeat("bob", busy_sid)  # still active: its request is pending
    assert svc.retrieve("bob", pending.request_id).status == "pending"
    assert wait(svc, "bob", svc.optim_step("bob", busy_run, 1, ADAM)).status == "complete"
    assert wait(svc, "bob", pending).status == "complete"


@pytest.mark.parametrize("exc", [
    MemoryError(),
    RuntimeError("unable to mmap 342000 bytes from file </srv/ember/models/q/model.safetensors>: "
                 "Cannot allocate memory (12)"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                 "you tried to allocate 1099511627776 bytes"),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    OSError(12, "Cannot allocate memory", "/srv/ember/data/checkpoints/x"),
])
def test_out_of_memory_is_one_message_without_server_paths(exc):
    msg = public_message(exc)
    assert msg.startswith("out of memory:") and type(exc).__name__ in msg
    assert "/srv" not in msg and "safetensors" not in msg


def test_internal_errors_have_absolute_paths_replaced():
    msg = public_message(KeyError("/srv/ember/data/checkpoints/run_1/weights/a missing for tinker://r/weights/a"))
    assert "/srv" not in msg and "<path>" in msg and "tinker://r/weights/a" in msg
