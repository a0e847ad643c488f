"""Idle session expiry and out-of-memory messages in the service (issue 24, item 5), and
each per-key check of `service/quotas.py` as a function; the quotas are tested against
`ember serve` in tests/server/test_server_quotas.py."""

from __future__ import annotations

import pytest
import torch
from tinker import types

from ember.service import SessionGoneError, UserError, quotas
from ember.service.limits import Limits
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


# ---------------------------------------------------------------------- the checks themselves (service/quotas.py)
@pytest.mark.parametrize("name, check", [
    ("max_runs_per_key", lambda n, q: quotas.check_runs(n, q)),
    ("max_sessions_per_key", lambda n, q: quotas.check_sessions(n, q, 1800.0, 300.0)),
    ("max_sampling_sessions_per_key", lambda n, q: quotas.check_sampling_sessions(n, q, 1800.0, 300.0)),
    ("max_checkpoint_bytes_per_key", lambda n, q: quotas.check_checkpoint_bytes(n, q)),
])
def test_each_count_quota_passes_below_its_limit_and_refuses_at_it_naming_it(name, check):
    check(2, 3)  # one more fits
    with pytest.raises(UserError, match=rf"this API key.*\b3\b.*limits\.{name}=3; "):
        check(3, 3)


def test_a_save_over_the_checkpoint_bytes_quota_is_refused_naming_its_size_and_no_quota_refuses_nothing():
    quotas.check_checkpoint_bytes_after("tinker://r/weights/a", 10, 15, 15)  # exactly at the quota: kept
    with pytest.raises(UserError, match=r"saving tinker://r/weights/a \(10 bytes\) would bring .* to 16 bytes"):
        quotas.check_checkpoint_bytes_after("tinker://r/weights/a", 10, 16, 15)
    quotas.check_checkpoint_bytes(10**15, None)
    quotas.check_checkpoint_bytes_after("tinker://r/weights/a", 10**15, 10**15, None)
    quotas.check_sessions(10**6, None, None, 300.0)


def test_queued_work_is_bounded_per_owner_and_freed_on_release():
    work = quotas.QueuedWork(Limits(max_queued_samples_per_key=4, max_queued_sample_tokens_per_key=100))
    work.reserve("alice", 3, 60)
    work.reserve("bob", 4, 100)  # another owner's work counts on its own
    with pytest.raises(UserError, match="this key has 3 samples queued or running; 2 more would pass the limit "
                                        "max_queued_samples_per_key=4"):
        work.reserve("alice", 2, 10)
    with pytest.raises(UserError, match=r"this key has 60 sample tokens .* 50 more would pass the limit "
                                        "max_queued_sample_tokens_per_key=100"):
        work.reserve("alice", 1, 50)
    assert work.of("alice") == (3, 60) and work.total() == (7, 160)  # a refusal reserves nothing
    work.release("alice", 3, 60)
    assert work.of("alice") == (0, 0) and work.total() == (4, 100)
