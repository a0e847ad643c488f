"""Fixtures for the service tests: a real Service (SQLite, lanes, TorchEngines) per test."""

from __future__ import annotations

import threading

import pytest
from tinker import types

from ember.service import Service, ServiceConfig


@pytest.fixture
def make_service(tmp_path, tiny_model_dir):
    services = []

    def make(data_dir=None, clock=None, **overrides) -> Service:
        cfg = ServiceConfig(data_dir=data_dir or tmp_path / "data", models={"tiny": str(tiny_model_dir)}, **overrides)
        svc = Service(cfg, clock=clock)
        services.append(svc)
        return svc

    yield make
    for svc in services:
        svc.close()


def wait(svc, owner, sub, timeout=60.0):
    """Block until the future of `sub` is done; return its FutureState."""
    state = svc.retrieve(owner, sub.request_id, timeout)
    assert state.done, f"future {sub.request_id} not done after {timeout}s"
    return state


def result(svc, owner, sub, timeout=60.0):
    state = wait(svc, owner, sub, timeout)
    assert state.status == "complete", f"{state.request_type} failed: {state.category} {state.error}"
    return state.result


def lane_drained(svc, owner, model_id, timeout=60.0) -> None:
    """Return once every op already queued on the run's lane has run: a marker op queued now
    runs after them (a lane runs one owner's ops in order), so what the sequencer released to
    the lane before this call has finished, however slow the host."""
    run = svc.debug_state().runs[model_id]
    ran = threading.Event()
    run.lane.submit(ran.set, run.seq.owner)
    assert ran.wait(timeout), f"the lane of {model_id} did not drain in {timeout} s"


def new_run(svc, owner="alice", rank=4, seed=0, base="tiny"):
    sid = svc.create_session(owner).session_id
    sub = svc.create_model(owner, sid, 0, base, types.LoraConfig(rank=rank, seed=seed))
    result(svc, owner, sub)
    return sid, sub.model_id
