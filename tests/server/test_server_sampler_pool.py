"""`ember serve --sampler.replicas 2`: a real server, the official SDK, two local replica
processes. A sampling client's requests all land on one replica (the per-replica
counter of `/metrics`); a replica that stops answering fails only its own clients'
requests, with category `server`, shows `ember_sampler_replica_up 0`, is replaced, and
every client samples again."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import tinker
from tinker import types

import httpx

from helpers.server import MODEL_NAME, API_KEY, start_server, wait_until

from .test_server_metrics import parse, value

pytestmark = pytest.mark.slow
TIMEOUT_S = 10


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = start_server(Path(tiny_model_dir), tmp_path_factory.mktemp("ember-pool"), timeout=600, extra_args=[
        "--sampler.replicas", "2", "--sampler.replica_timeout_s", str(TIMEOUT_S),
        "--sampler.max_imbalance", "1000"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def sc(server):
    client = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    yield client
    client.close("success").result(timeout=30)


def scrape(base_url: str) -> dict:
    resp = httpx.get(f"{base_url}/metrics", headers={"X-API-Key": API_KEY}, timeout=120)  # a loaded machine
    assert resp.status_code == 200, resp.text
    return parse(resp.text)


def _requests(samples: dict) -> list[float]:
    return [value(samples, "ember_sampler_replica_requests_total", model=MODEL_NAME, replica=str(r))
            for r in range(2)]


def _up(samples: dict) -> list[float]:
    return [value(samples, "ember_sampler_replica_up", model=MODEL_NAME, replica=str(r)) for r in range(2)]


def _sample(client, seed: int = 1):
    return client.sample(types.ModelInput.from_ints([5, 17, 30]), num_samples=1,
                         sampling_params=types.SamplingParams(max_tokens=4, seed=seed, stop=[]))


def _replica_processes(server) -> list[psutil.Process]:
    """The replicas: children of the server's multiprocessing forkserver (ember.forkserver)."""
    forkservers = [p for p in psutil.Process(server.proc.pid).children()
                   if "multiprocessing.forkserver" in " ".join(p.cmdline())]  # not the resource tracker
    return [replica for forkserver in forkservers for replica in forkserver.children()]


@pytest.fixture(scope="module")
def placed(server, sc):
    """Sampling clients and the replica each one's requests went to (both replicas used)."""
    out: dict[int, list] = {0: [], 1: []}
    for _ in range(24):
        client = sc.create_sampling_client(base_model=MODEL_NAME).result()
        before = _requests(scrape(server.base_url))
        for k in range(3):
            assert _sample(client, k).result(timeout=300).sequences
        delta = [a - b for a, b in zip(_requests(scrape(server.base_url)), before)]
        assert sorted(delta) == [0, 3], delta  # all of this session's requests on one replica
        out[delta.index(3)].append(client)
        if out[0] and out[1]:
            return out
    pytest.fail(f"24 sampling sessions, none on one of the replicas: {[len(v) for v in out.values()]}")


def test_a_sampling_clients_requests_land_on_one_replica(server, placed):
    samples = scrape(server.base_url)
    assert _up(samples) == [1.0, 1.0]
    assert len(_replica_processes(server)) == 2


def test_a_silent_replica_fails_only_its_clients_as_server_and_is_replaced(server, placed):
    procs = _replica_processes(server)
    assert len(procs) == 2
    victim = procs[0]
    os.kill(victim.pid, signal.SIGSTOP)  # alive but answering nothing: replica_timeout_s takes it out
    try:
        futures = {r: [_sample(c) for c in clients] for r, clients in placed.items()}
        outcomes = {r: [_outcome(f) for f in fs] for r, fs in futures.items()}
    finally:
        os.kill(victim.pid, signal.SIGKILL)
    dead = [r for r, results in outcomes.items() if all(o == "server" for o in results)]
    live = [r for r, results in outcomes.items() if all(o == "ok" for o in results)]
    assert len(dead) == 1 and len(live) == 1, outcomes
    wait_until(lambda: _up(scrape(server.base_url)) == [1.0, 1.0], timeout=600, message="a replacement replica up")
    assert victim.pid not in {p.pid for p in _replica_processes(server)}
    for clients in placed.values():  # the moved sessions and the others all sample again
        for client in clients:
            assert _sample(client).result(timeout=300).sequences


def _outcome(future) -> str:
    start = time.monotonic()
    try:
        future.result(timeout=TIMEOUT_S + 120)
        return "ok"
    except tinker.RequestFailedError as exc:
        assert time.monotonic() - start < TIMEOUT_S + 120
        return "server" if exc.category == types.RequestErrorCategory.Server else f"other: {exc}"
