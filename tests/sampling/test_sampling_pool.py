"""SamplerPool (ember.sampling.pool): session affinity from the per-replica counters,
replicas killed or silenced (only their sessions move, only their in-flight requests
fail, category `server`), replacement with the live versions, and replicas=1 = no pool.

The pool's semantics (seeds, stops, logprobs vs forward, versions, bad input) are the
conformance suite's: the `pool` parameter of tests/sampling/conftest.py."""

from __future__ import annotations

import os
import signal
import time

import pytest
from tinker import types

from helpers.server import wait_until

from ember.models import load_model
from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler, create_sampler
from ember.sampling.pool import SamplerPool
from ember.sampling.replica import ReplicaFailed
from ember.sampling.router import HashRing, SessionRouter

from .conftest import POOL_CONFIG, params, prompt

TIMEOUT_S = POOL_CONFIG["replica_timeout_s"]  # a silenced replica is out after this


@pytest.fixture
def pool(pool_sampler):
    """The session's 2-replica pool (conftest): whole again after each test here."""
    _wait_all_up(pool_sampler)
    yield pool_sampler
    _wait_all_up(pool_sampler)


def _request(session: str, max_tokens: int = 4, seed: int = 1, version=None) -> SamplingRequest:
    return SamplingRequest(prompt=prompt([5, 6, 7]), num_samples=2, version=version, session=session,
                           sampling_params=params(max_tokens=max_tokens, seed=seed, stop=[]))


def _sessions_by_home(pool: SamplerPool, n: int = 4) -> dict[int, list[str]]:
    """Fresh session ids whose consistent-hash home is each replica (the pool's ring of both
    replicas, up: `ember.sampling.router`'s hash is the same in every process)."""
    ring = HashRing(range(pool.config.replicas))
    homes: dict[int, list[str]] = {0: [], 1: []}
    i = 0
    while min(len(v) for v in homes.values()) < n:
        s = f"test-session-{time.monotonic_ns()}-{i}"
        homes[ring.lookup(s)].append(s)
        i += 1
    return {r: v[:n] for r, v in homes.items()}


def _totals(pool: SamplerPool) -> list[int]:
    return [s["requests_total"] for s in pool.replica_stats()]


def _wait_all_up(pool: SamplerPool, timeout: float = 600.0) -> None:
    wait_until(lambda: all(s["up"] for s in pool.replica_stats()), timeout, interval=0.5,
               message="every replica up again")


def test_replicas_1_is_no_pool(tiny_model_dir):
    sampler = create_sampler(tiny_model_dir, SamplerConfig(max_slots=2))
    try:
        assert type(sampler) is TorchSampler
    finally:
        sampler.close()


@pytest.mark.slow  # the pool's two replica processes start for it; test_sampling_router.py and the unit tests here stay in test-fast
def test_a_sessions_requests_land_on_one_replica(pool):
    homes = _sessions_by_home(pool, n=3)
    for replica, sessions in homes.items():
        for session in sessions:
            before = _totals(pool)
            results = pool.sample_many([_request(session, seed=k) for k in range(4)], timeout=120)
            assert all(isinstance(r, types.SampleResponse) for r in results), results
            delta = [a - b for a, b in zip(_totals(pool), before)]
            assert delta[replica] == 4 and sum(delta) == 4, (session, replica, delta)
            assert pool.route_of(session) == replica
    # The same request on the other replica gives the same tokens (seeded, same weights).
    a = pool.submit(_request(homes[0][0], seed=9)).result(120)
    b = pool.submit(_request(homes[1][0], seed=9)).result(120)
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]


@pytest.mark.slow  # a replacement replica starts (20-60 s here)
def test_killed_replica_fails_only_its_requests_and_is_replaced(pool, tiny_model_dir):
    version = pool.load_weights(dict(load_model(tiny_model_dir).state_dict()))
    homes = _sessions_by_home(pool, n=3)
    for sessions in homes.values():  # place them
        pool.sample_many([_request(s, version=version) for s in sessions], timeout=120)
    reference = pool.submit(_request(homes[0][0], seed=5, version=version)).result(120)
    victim_pid = pool.replica_pids()[1]
    os.kill(victim_pid, signal.SIGSTOP)  # hold its requests in flight, then kill it
    try:
        doomed = [pool.submit(_request(s, max_tokens=8, version=version)) for s in homes[1]]
        survivors = [pool.submit(_request(s, max_tokens=8, version=version)) for s in homes[0]]
    finally:
        os.kill(victim_pid, signal.SIGKILL)
    for fut in doomed:
        exc = fut.exception(timeout=120)
        # A RuntimeError, not a ValueError: the service reports it with category `server`.
        assert isinstance(exc, ReplicaFailed) and not isinstance(exc, ValueError), exc
    assert all(isinstance(f.result(timeout=120), types.SampleResponse) for f in survivors)
    # Only the dead replica's sessions moved; the others kept their replica.
    assert [pool.route_of(s) for s in homes[0]] == [0, 0, 0]
    assert all(pool.route_of(s) is None for s in homes[1])
    moved = pool.sample_many([_request(s, version=version) for s in homes[1]], timeout=120)
    assert all(isinstance(r, types.SampleResponse) for r in moved), moved
    assert [pool.route_of(s) for s in homes[1]] == [0, 0, 0]
    # A replacement starts in the same slot, gets the live version and serves new sessions.
    _wait_all_up(pool)
    assert pool.replica_stats()[1]["restarts"] == 1 and pool.replica_pids()[1] != victim_pid
    fresh = _sessions_by_home(pool, n=1)[1][0]
    again = pool.submit(_request(fresh, seed=5, version=version)).result(120)
    assert pool.route_of(fresh) == 1
    assert [s.tokens for s in again.sequences] == [s.tokens for s in reference.sequences]


@pytest.mark.slow  # waits out replica_timeout_s, then a replacement starts
def test_silent_replica_is_taken_out_and_never_blocks_a_sync(pool, tiny_model_dir):
    homes = _sessions_by_home(pool, n=2)
    silent_pid = pool.replica_pids()[0]
    os.kill(silent_pid, signal.SIGSTOP)  # alive, but answers nothing
    try:
        stuck = pool.submit(_request(homes[0][0]))
        other = pool.submit(_request(homes[1][0]))
        assert isinstance(other.result(timeout=120), types.SampleResponse)
        start = time.monotonic()
        # A weight sync while one replica is silent returns once it is taken out (timeout + a ping interval).
        version = pool.load_weights(dict(load_model(tiny_model_dir).state_dict()))
        assert time.monotonic() - start < TIMEOUT_S + 60
        assert isinstance(stuck.exception(timeout=120), ReplicaFailed)
        assert not pool.replica_stats()[0]["up"]
        response = pool.submit(_request(homes[0][0], version=version)).result(120)
        assert pool.route_of(homes[0][0]) == 1 and response.sequences
    finally:
        try:
            os.kill(silent_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _queue_depths(pool: SamplerPool) -> dict[str, float]:
    """`ember_sampler_replica_queue_depth` by replica, as `/metrics` renders it for this pool."""
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from ember.server.metrics import EmberMetrics
    from ember.service.api import ServiceGauges

    service = SimpleNamespace(gauges=lambda: ServiceGauges(replicas={"tiny": pool.replica_stats()}),
                              add_weight_sync_listener=lambda fn: None, checkpoint_bytes=lambda owner: 0)
    text = EmberMetrics(service).render().decode()
    return {s.labels["replica"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "ember_sampler_replica_queue_depth" and s.labels["model"] == "tiny"}


@pytest.mark.slow  # the pool's two replica processes start for it; test_sampling_router.py and the unit tests here stay in test-fast
def test_queue_depth_gauge_counts_a_replicas_unanswered_requests(pool):
    """`ember_sampler_replica_queue_depth{model,replica}`: requests routed to a replica and
    not answered yet. A stopped replica (SIGSTOP, well under replica_timeout_s) holds three;
    the other replica's gauge stays 0; both read 0 once the answers are in."""
    assert _queue_depths(pool) == {"0": 0.0, "1": 0.0}
    sessions = _sessions_by_home(pool, n=1)[0]
    pid = pool.replica_pids()[0]
    os.kill(pid, signal.SIGSTOP)
    try:
        futures = [pool.submit(_request(sessions[0], seed=k)) for k in range(3)]
        assert _queue_depths(pool) == {"0": 3.0, "1": 0.0}
        assert [s["in_flight"] for s in pool.replica_stats()] == [3, 0]
    finally:
        os.kill(pid, signal.SIGCONT)
    assert all(isinstance(f.result(timeout=120), types.SampleResponse) for f in futures)
    assert _queue_depths(pool) == {"0": 0.0, "1": 0.0}


class _NoReplicaRouter(SessionRouter):
    """The pool's router with both replicas out of the ring, as while both are being replaced."""

    def __init__(self, replicas, max_imbalance: int) -> None:
        super().__init__([], max_imbalance)


@pytest.mark.slow  # the pool's two replica processes start for it; test_sampling_router.py and the unit tests here stay in test-fast
def test_requests_while_no_replica_is_up_fail_at_once(pool):
    pool.use_router(_NoReplicaRouter)
    try:
        fut = pool.submit(_request("no-replica"))
        assert isinstance(fut.exception(timeout=5), ReplicaFailed)
        assert "no sampler replica is up" in str(fut.exception())
    finally:
        pool.use_router(SessionRouter)  # both back in the ring
    assert pool.submit(_request("no-replica")).result(120).sequences


def test_host_config_gives_each_replica_its_device():
    from ember.sampling.replica import host_config

    cfg = SamplerConfig(replicas=3, devices=["cuda:1", "cuda:2"], device="cuda:0")
    assert [host_config(cfg, i).device for i in range(3)] == ["cuda:1", "cuda:2", "cuda:1"]
    assert all(host_config(cfg, i).replicas == 1 and host_config(cfg, i).devices is None for i in range(3))
    assert host_config(SamplerConfig(replicas=2, device="cpu"), 1).device == "cpu"
    for bad, match in [(dict(replicas=0), "replicas"), (dict(placement="moon"), "placement"),
                       (dict(devices=["gpu1"]), r"devices\[0\]"), (dict(devices=[]), "devices"),
                       (dict(max_imbalance=-1), "max_imbalance"), (dict(replica_timeout_s=0), "replica_timeout_s")]:
        with pytest.raises(ValueError, match=match):
            SamplerConfig(**bad)


@pytest.mark.gpu
def test_cuda_replicas_each_on_their_device(tiny_model_dir, ref_model):
    import torch

    n = torch.cuda.device_count()
    devices = [f"cuda:{i % n}" for i in range(2)]
    with SamplerPool(tiny_model_dir, SamplerConfig(replicas=2, devices=devices, dtype="float32", max_slots=8)) as p:
        infos = p.debug_state(60)["infos"]
        assert [i.device for i in infos] == devices
        tokens = [5, 6, 7, 8, 9]
        got = p.compute_logprobs(prompt(tokens))[1:]
        from .conftest import full_logprobs

        want = full_logprobs(ref_model, tokens).numpy()
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3
