"""docs/protocol.md §9 items that need the server to answer in special ways or with
other client-config flags (4, 5, 6, 10, 15, 33, 36-38, 40-42).

The server is the real `ember serve` app wrapped by the test-only tests/server/fault_server.py
(fault injection + client-config overrides), started as a subprocess under a path prefix.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from helpers.server import API_KEY, MODEL_NAME, paths, sft_datum, start_server, wait_until

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

PREFIX = "/tinker-prefix"
ADAM = types.AdamParams(learning_rate=2e-2)
DATA = [sft_datum([3, 5, 7, 9, 11]), sft_datum([2, 4, 6, 8, 10, 12, 14])]


class Faults:
    def __init__(self, server):
        self.server, self.url = server, server.base_url + PREFIX
        self.persistent: list[dict] = []

    def set(self, *rules: dict) -> None:
        r = httpx.post(f"{self.url}/_test/faults", json={"rules": [*self.persistent, *rules]}, timeout=10)
        r.raise_for_status()

    def client_config(self, **flags) -> None:
        httpx.post(f"{self.url}/_test/client_config", json=flags, timeout=10).raise_for_status()

    def client(self) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.url, api_key=API_KEY)


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[tuple[int, str]] = []

    def emit(self, record):
        self.messages.append((record.levelno, record.getMessage()))


@pytest.fixture(scope="module")
def faults(tiny_model_dir, tmp_path_factory):
    server = start_server(Path(tiny_model_dir), tmp_path_factory.mktemp("fault-serve"),
                          script=Path(__file__).with_name("fault_server.py"), extra_args=["--path-prefix", PREFIX])
    yield Faults(server)
    server.stop()


@pytest.fixture(scope="module")
def sdk_log():
    records, logger = Records(), logging.getLogger("tinker")
    old = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(records)
    yield records
    logger.removeHandler(records)
    logger.setLevel(old)


@pytest.fixture(scope="module")
def gone_session(faults, sdk_log):
    """A session whose heartbeats are answered 410 (checked by the last test)."""
    sc = faults.client()
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
    session_id = tc.get_info().model_id.split(":train:")[0]
    faults.persistent = [{"path": "/session_heartbeat", "status": 410, "body_contains": session_id,
                          "body": {"error": "session finished", "category": "user"}}]
    faults.set()
    yield session_id, time.monotonic()
    sc.close("success").result(timeout=30)


def new_tc(sc, seed=0):
    return sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=seed).result()


def ce_loss(out, data) -> float:
    return -sum(float((d.loss_fn_inputs["weights"].to_numpy() * o["logprobs"].to_numpy()).sum())
                for d, o in zip(data, out.loss_fn_outputs, strict=True))


def test_path_prefix_routes_everything(faults, gone_session):
    mark = faults.server.log_mark()
    sc = faults.client()
    tc = new_tc(sc)
    tc.forward_backward(DATA, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    entries = faults.server.requests_since(mark)
    assert entries and all(e["path"].startswith(PREFIX + "/api/v1/") for e in entries)
    r = httpx.post(f"{faults.server.base_url}/api/v1/client/config", headers={"X-API-Key": API_KEY}, json={})
    assert r.status_code == 404 and r.json()["category"] == "user"
    sc.close("success").result(timeout=30)


@pytest.mark.parametrize("pyqwest", [False, True])
def test_sft_over_both_transports(faults, gone_session, pyqwest):
    faults.client_config(use_pyqwest_transport=pyqwest)
    sc = faults.client()
    try:
        tc = new_tc(sc)
        out = tc.forward_backward(DATA, "cross_entropy").result()
        assert out.metrics["loss:sum"] == pytest.approx(ce_loss(out, DATA), rel=1e-5)
        tc.optim_step(ADAM).result()
        assert tc.forward(DATA, "cross_entropy").result().metrics["loss:sum"] < out.metrics["loss:sum"]
    finally:
        sc.close("success").result(timeout=30)
        faults.client_config(use_pyqwest_transport=False)


@pytest.mark.parametrize("answer", [{"status": 404}, {"status": 200, "body": {}}])
def test_dynamic_config_404_or_empty(faults, gone_session, answer):
    faults.set({"path": "/client/dynamic_config", **answer})
    mark = faults.server.log_mark()
    sc = faults.client()
    try:
        new_tc(sc)
        dyn = faults.server.requests_since(mark, "/client/dynamic_config")
        assert dyn[0]["status"] == answer["status"]
        assert "/create_session" in paths(faults.server.requests_since(mark))
    finally:
        faults.set()
        sc.close("success").result(timeout=30)


@pytest.mark.parametrize("parallel", [True, False])
def test_chunked_forward_backward(faults, gone_session, parallel):
    faults.client_config(fwdbwd_max_chunk_len=1, parallel_fwdbwd_chunks=parallel)
    sc = faults.client()
    try:
        tc = new_tc(sc)
        data = DATA + [sft_datum([1, 2, 3, 4, 5, 6, 7, 8, 9])]
        mark = faults.server.log_mark()
        out = tc.forward_backward(data, "cross_entropy").result()
        arrived = [e["extra"]["seq_id"] for e in faults.server.requests_since(mark, "/forward_backward")]
        assert sorted(arrived) == [1, 2, 3]
        assert arrived == ([2, 3, 1] if parallel else [1, 2, 3]) or (parallel and arrived[-1] == 1)
        assert [o["logprobs"].shape[0] for o in out.loss_fn_outputs] == [4, 6, 8]  # input order
        assert out.metrics["loss:sum"] == pytest.approx(ce_loss(out, data), rel=1e-5)
        tc.optim_step(ADAM).result()  # seq 4 runs after chunks 1-3
    finally:
        sc.close("success").result(timeout=30)
        faults.client_config(fwdbwd_max_chunk_len=1024, parallel_fwdbwd_chunks=False)


def test_zstd_compressed_forward_backward(faults, gone_session):
    faults.client_config(proto_compress_fwdbwd=True)
    sc = faults.client()
    try:
        tc = new_tc(sc)
        mark = faults.server.log_mark()
        out = tc.forward_backward(DATA, "cross_entropy").result()
        sent = faults.server.requests_since(mark, "/forward_backward")
        assert sent[0]["headers"].get("content-encoding") == "zstd" and sent[0]["status"] == 200
        assert out.metrics["loss:sum"] == pytest.approx(ce_loss(out, DATA), rel=1e-5)
    finally:
        sc.close("success").result(timeout=30)
        faults.client_config(proto_compress_fwdbwd=False)


def test_rejected_submission_leaves_a_gap_that_is_skipped_and_long_polled(faults, gone_session, sdk_log):
    sc = faults.client()
    try:
        tc = new_tc(sc)
        faults.set({"path": "/forward_backward", "status": 422, "times": 1,
                    "body": {"error": "injected 422", "category": "user"}})
        with pytest.raises(tinker.UnprocessableEntityError):
            tc.forward_backward(DATA, "cross_entropy").result()
        mark, warnings_before = faults.server.log_mark(), len(sdk_log.messages)
        start = time.monotonic()
        tc.optim_step(ADAM).result()  # seq 2 waits for the missing seq 1 (gap timeout, 5 s)
        waited = time.monotonic() - start
        assert waited > 4.0
        polls = faults.server.requests_since(mark, "/retrieve_future")
        assert 1 <= len(polls) <= 2 and all(p["extra"]["request_type"] == "OptimStep" for p in polls)
        assert not [m for _, m in sdk_log.messages[warnings_before:] if "try_again" in m]
        out = tc.forward_backward(DATA, "cross_entropy").result()  # seq 3 flows normally
        assert out.metrics["loss:sum"] > 0
    finally:
        faults.set()
        sc.close("success").result(timeout=30)


def test_retrieve_408_once_then_result(faults, gone_session):
    sc = faults.client()
    try:
        tc = new_tc(sc)
        faults.set({"path": "/retrieve_future", "status": 408, "times": 1, "header": {"x-tinker-request-type": "OptimStep"},
                    "body": {"type": "try_again", "request_id": "x", "queue_state": "active"}})
        mark = faults.server.log_mark()
        tc.forward_backward(DATA, "cross_entropy").result()
        assert tc.optim_step(ADAM).result() is not None
        polls = [e["status"] for e in faults.server.requests_since(mark, "/retrieve_future")
                 if e["headers"].get("x-tinker-request-type") == "OptimStep"]
        assert polls == [408, 200]
    finally:
        faults.set()
        sc.close("success").result(timeout=30)


def test_retrieve_410_for_a_sample_resubmits(faults, gone_session):
    sc = faults.client()
    try:
        sampler = sc.create_sampling_client(base_model=MODEL_NAME).result()
        faults.set({"path": "/retrieve_future", "status": 410, "times": 1, "header": {"x-tinker-request-type": "Sample"}})
        mark = faults.server.log_mark()
        resp = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 2,
                              types.SamplingParams(max_tokens=4, seed=1, stop=[])).result()
        assert len(resp.sequences) == 2 and all(len(s.tokens) == 4 for s in resp.sequences)
        submitted = faults.server.requests_since(mark, "/asample")
        assert len(submitted) == 2 and submitted[0]["json"]["seq_id"] != submitted[1]["json"]["seq_id"]
        assert [s.sequence_id for s in resp.sequences] == submitted[1]["response"]["sample_sequence_ids"]
    finally:
        faults.set()
        sc.close("success").result(timeout=30)


def test_submission_503_twice_then_ok_and_400_is_final(faults, gone_session):
    sc = faults.client()
    try:
        tc = new_tc(sc)
        tc.forward_backward(DATA, "cross_entropy").result()
        faults.set({"path": "/optim_step", "status": 503, "times": 2})
        mark = faults.server.log_mark()
        tc.optim_step(ADAM).result()
        attempts = faults.server.requests_since(mark, "/optim_step")
        assert [a["status"] for a in attempts] == [503, 503, 200]
        assert len({a["json"]["seq_id"] for a in attempts}) == 1
        faults.set({"path": "/optim_step", "status": 400, "times": 1,
                    "body": {"error": "bad optimizer step", "category": "user"}})
        mark = faults.server.log_mark()
        with pytest.raises(tinker.BadRequestError, match="bad optimizer step"):
            tc.optim_step(ADAM).result()
        assert [a["status"] for a in faults.server.requests_since(mark, "/optim_step")] == [400]
    finally:
        faults.set()
        sc.close("success").result(timeout=30)


def test_resubmitted_forward_backward_is_applied_once(faults, gone_session):
    sc = faults.client()
    try:
        reference, retried = new_tc(sc, seed=21), new_tc(sc, seed=21)
        reference.forward_backward(DATA, "cross_entropy").result()
        reference.optim_step(ADAM).result()
        # the server accepts seq 1, but the client only sees a 503 and sends it again
        faults.set({"path": "/forward_backward", "status": 503, "times": 1, "after": True})
        mark = faults.server.log_mark()
        retried.forward_backward(DATA, "cross_entropy").result()
        sent = faults.server.requests_since(mark, "/forward_backward")
        assert [(e["status"], e["extra"]["seq_id"]) for e in sent] == [(503, 1), (200, 1)]
        retried.optim_step(ADAM).result()
        want = reference.forward(DATA, "cross_entropy").result().loss_fn_outputs
        got = retried.forward(DATA, "cross_entropy").result().loss_fn_outputs
        for a, b in zip(want, got, strict=True):
            np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), rtol=1e-6, atol=1e-6)
    finally:
        faults.set()
        sc.close("success").result(timeout=30)


def test_heartbeat_410_stops_the_heartbeat_loop(faults, gone_session, sdk_log):
    """Last: the session is > 10 s old now; wait until a second heartbeat would be due."""
    session_id, created = gone_session

    def beats():
        return [e for e in faults.server.requests("/session_heartbeat") if e["json"].get("session_id") == session_id]

    wait_until(beats, timeout=max(1.0, 25 - (time.monotonic() - created)), message="first heartbeat")
    time.sleep(max(0.0, 23 - (time.monotonic() - created)))
    assert [b["status"] for b in beats()] == [410]
    stops = [m for level, m in sdk_log.messages if session_id in m and "stopping its heartbeat loop" in m]
    assert len(stops) == 1 and (logging.INFO, stops[0]) in sdk_log.messages
