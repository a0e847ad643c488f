"""Every future finishes, over HTTP with the official SDK (issue 16 items 2 and 3).

The server is the real `ember serve` app wrapped by tests/server/fault_server.py, whose
`/_test/failpoints` arms `ember.failpoints` inside the server process.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import httpx
import orjson
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from ember.server import wire
from ember.server.deps import model_response
from helpers.server import API_KEY, MODEL_NAME, sft_datum, start_server, wait_until
from helpers.zygote import run_module

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

RETRY_S, LOCK_S = 1.0, 0.3
BOUND_S = RETRY_S + 2 * LOCK_S + 3.0  # the stated bound plus HTTP polling and a busy 2-core machine
DATA = [sft_datum([3, 5, 7, 9, 11])]
LEAKS = ("UPDATE", "INSERT", "SELECT", "[SQL", "sqlalche.me", "/", "Traceback")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = start_server(
        Path(tiny_model_dir), tmp_path_factory.mktemp("fault-futures"),
        script=Path(__file__).with_name("fault_server.py"),
        extra_args=["--durability.finish_retry_s", str(RETRY_S), "--durability.db_lock_timeout_s", str(LOCK_S)],
    )
    yield srv
    srv.stop()


def _failpoint(server, name: str, action: str | None, times: int = -1) -> None:
    httpx.post(f"{server.base_url}/_test/failpoints", json={"name": name, "action": action, "times": times},
               timeout=10).raise_for_status()


@pytest.fixture
def training(server):
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    return sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()


def _assert_clean(message: str) -> None:
    assert not any(leak in message for leak in LEAKS), message


def test_a_result_the_database_refuses_ends_as_server_and_the_next_request_succeeds(server, training):
    _failpoint(server, "futures.finish_write", "dblocked")
    try:
        start = time.monotonic()
        with pytest.raises(tinker.RequestFailedError) as info:
            training.forward_backward(DATA, "cross_entropy").result(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        _failpoint(server, "futures.finish_write", None)
    assert info.value.category == types.RequestErrorCategory.Server
    assert "could not be stored (database error: database is locked)" in info.value.message
    _assert_clean(info.value.message)
    assert elapsed < BOUND_S, f"the SDK saw the failure after {elapsed:.2f}s, bound {BOUND_S}s"
    out = training.forward_backward(DATA, "cross_entropy").result(timeout=60)
    assert out.metrics["loss:sum"] > 0


def test_a_write_lock_held_by_another_process_is_a_clean_server_error_then_clears(server, training):
    """A write that waits out the lock answers 500 `server` without SQL; the SDK retries
    it, and it succeeds once the lock is released."""
    db = server.data_dir / "ember.db"
    holder = sqlite3.connect(db, timeout=5)
    holder.execute("BEGIN IMMEDIATE")
    try:
        r = httpx.post(f"{server.base_url}/api/v1/create_session", headers={"X-API-Key": API_KEY},
                       json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0", "type": "create_session"},
                       timeout=30)
        assert r.status_code == 500, r.text
        body = r.json()
        assert body["category"] == "server" and "database is locked" in body["error"], body
        _assert_clean(body["error"])
        # The SDK's own call, started while locked, succeeds after the lock goes away.
        fut = training.forward_backward(DATA, "cross_entropy")
        time.sleep(1.0)
    finally:
        holder.rollback()
        holder.close()
    assert fut.result(timeout=120).metrics["loss:sum"] > 0


def test_a_create_call_that_fails_after_recording_its_future_is_answered_by_the_retry(server, training):
    """The first submission records its future, then fails (500); the SDK retries the
    same call (same seq_id, so the same future) and gets it failed, not try_again for ever."""
    _failpoint(server, "futures.after_create", "raise", times=1)
    start = time.monotonic()
    with pytest.raises(tinker.RequestFailedError) as info:
        training.forward_backward(DATA, "cross_entropy").result(timeout=60)
    assert time.monotonic() - start < 30
    assert info.value.category == types.RequestErrorCategory.Server
    assert "could not be queued" in info.value.message
    _assert_clean(info.value.message)
    assert training.forward_backward(DATA, "cross_entropy").result(timeout=60).metrics["loss:sum"] > 0


def _raw_forward(server, model_id: str, seq_id: int, data) -> str:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id)
    msg = forward_backward_request_to_proto(req)
    msg.forward_only = True
    body = msg.SerializeToString()
    r = httpx.post(f"{server.base_url}/api/v1/forward_backward", content=body, timeout=30,
                   headers={"X-API-Key": API_KEY, "Content-Type": wire.PROTOBUF_CONTENT_TYPE})
    r.raise_for_status()
    return r.json()["request_id"]


def test_an_infinite_loss_fetched_as_json_is_a_valid_response(server, training):
    model_id = training.get_info().model_id
    huge = sft_datum([3, 5, 7, 9, 11], weights=[3e38] * 4)  # finite weights, a loss past float32's range
    rid = _raw_forward(server, model_id, 1, [huge])
    def answer() -> dict | None:  # a JSON-only client (no protobuf Accept), parsed as the SDK parses JSON: orjson
        r = httpx.post(f"{server.base_url}/api/v1/retrieve_future", headers={"X-API-Key": API_KEY},
                       json={"request_id": rid}, timeout=60)
        assert r.status_code == 200, r.text
        body = orjson.loads(r.content)
        return None if body.get("type") == "try_again" else body

    body = wait_until(answer, 60, interval=0, message=f"future {rid} to finish")
    assert "error" not in body, body
    assert body["metrics"]["loss:sum"] is None  # inf: JSON has no infinity


def test_result_json_replaces_non_finite_values_only_when_needed():
    out = types.ForwardBackwardOutput(
        loss_fn_output_type="cross_entropy", metrics={"loss:sum": float("inf"), "ok:mean": 1.5},
        loss_fn_outputs=[{"logprobs": types.TensorData(data=[float("nan"), -1.0], dtype="float32", shape=[2])}],
    )
    body = orjson.loads(model_response(out).body)
    assert body["metrics"] == {"loss:sum": None, "ok:mean": 1.5}
    assert body["loss_fn_outputs"][0]["logprobs"]["data"] == [None, -1.0]
    finite = model_response(types.OptimStepResponse(metrics={"a:mean": 2.0})).body
    assert orjson.loads(finite) == {"metrics": {"a:mean": 2.0}}


def test_start_up_on_a_corrupt_database_is_one_line_and_a_non_zero_exit(tiny_model_dir, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "ember.db").write_bytes(b"this is not a database " * 512)
    proc = run_module("ember.cli", ["serve", "--model", f"{MODEL_NAME}={tiny_model_dir}", "--data-dir", str(data),
                                    "--port", "0", "--api-key", API_KEY], cwd=tmp_path, env=os.environ, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("ember serve: cannot open the database") and "not a database" in lines[0]
