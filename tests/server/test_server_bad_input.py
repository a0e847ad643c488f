"""Bad input over raw HTTP: malformed JSON and protobuf, wrong dtypes, out-of-vocabulary
tokens, unknown models and losses, oversized bodies. Every answer is a 4xx with a JSON
body or a failed future with category "user", and the server keeps serving."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from helpers.server import API_KEY, MODEL_NAME, sft_datum

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

PROTO = {"Content-Type": "application/x-protobuf"}


@pytest.fixture(scope="module")
def http(ember_server):
    with httpx.Client(base_url=ember_server.base_url + "/api/v1", headers={"X-API-Key": API_KEY}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(ember_server):
    sc = tinker.ServiceClient(base_url=ember_server.base_url, api_key=API_KEY)
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
    yield tc.get_info().model_id
    sc.close("success").result(timeout=30)


def fb_body(model_id: str, seq_id: int, data=None, loss_fn="cross_entropy", config=None) -> pb.ForwardBackwardRequest:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data or [sft_datum([1, 2, 3, 4])], loss_fn=loss_fn,
                                                          loss_fn_config=config),
        model_id=model_id, seq_id=seq_id)
    return forward_backward_request_to_proto(req)


def assert_json_error(resp: httpx.Response, status: int, *words: str) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert body["category"] == "user" and body["error"]
    for w in words:
        assert w.lower() in body["error"].lower(), body["error"]
    return body


def outcome(http: httpx.Client, request_id: str) -> dict:
    for _ in range(20):
        r = http.post("/retrieve_future", json={"request_id": request_id}, headers={"Accept": "application/json"})
        assert r.status_code == 200, r.text
        body = r.json()
        if body.get("type") != "try_again":
            return body
    raise AssertionError("future never finished")


@pytest.mark.parametrize("path", ["/create_session", "/optim_step", "/asample", "/retrieve_future", "/create_model"])
def test_malformed_json_is_400_with_a_body(http, path):
    assert_json_error(http.post(path, content=b"{not json", headers={"Content-Type": "application/json"}),
                      400, "invalid JSON")
    assert_json_error(http.post(path, json=[1, 2]), 400, "expected a JSON object")


def test_schema_violations_are_422_with_details(http, model_id):
    r = http.post("/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": "fast"}})
    body = assert_json_error(r, 422, "learning_rate")
    assert body["detail"]
    assert_json_error(http.post("/create_model", json={"session_id": "s", "model_seq_id": "zero", "base_model": "b"}),
                      422, "model_seq_id")


@pytest.mark.parametrize("mutate, status, words", [
    (lambda m: b"\xff\xfe garbage", 400, ["not a valid"]),
    (lambda m: _set(m, lambda x: setattr(x.data[0].model_input[0].encoded_text, "tokens", b"\x01\x00")),
     400, ["datum 0", "multiple of 4"]),
    (lambda m: _set(m, lambda x: setattr(x.data[0].loss_fn_inputs["weights"], "dtype", pb.DTYPE_BFLOAT16)),
     400, ["datum 0", "weights", "dtype"]),
    (lambda m: _set(m, lambda x: setattr(x.data[0].loss_fn_inputs["target_tokens"], "dtype", pb.DTYPE_FLOAT32)),
     400, ["datum 0", "target_tokens", "needs 3 values, got 6"]),  # 3 int64 read as float32
])
def test_malformed_protobuf_is_400_naming_the_field(http, model_id, mutate, status, words):
    body = mutate(fb_body(model_id, 10_000))
    assert_json_error(http.post("/forward_backward", content=body, headers=PROTO), status, *words)


def _set(msg: pb.ForwardBackwardRequest, change) -> bytes:
    change(msg)
    return msg.SerializeToString()


def test_wrong_content_type_and_bad_zstd(http, model_id):
    good = fb_body(model_id, 10_001).SerializeToString()
    assert_json_error(http.post("/forward_backward", content=good, headers={"Content-Type": "application/json"}),
                      400, "x-protobuf")
    assert_json_error(http.post("/forward_backward", content=b"notzstd",
                                headers={**PROTO, "Content-Encoding": "zstd"}), 400, "zstd")


def test_oversized_bodies_are_413_or_400(http, model_id):
    big = b"\x00" * (5 * 1024 * 1024)  # the shared server runs with --max-body-mb 4
    assert_json_error(http.post("/forward_backward", content=big, headers=PROTO), 413, "exceeds")

    def chunks():  # no Content-Length: the limit is enforced while streaming
        for _ in range(5):
            yield b"\x00" * (1024 * 1024)

    assert_json_error(http.post("/forward_backward", content=chunks(), headers=PROTO), 413, "exceeds")
    bomb = zstandard.ZstdCompressor().compress(b"\x00" * (5 * 1024 * 1024))
    assert len(bomb) < 10_000
    assert_json_error(http.post("/forward_backward", content=bomb, headers={**PROTO, "Content-Encoding": "zstd"}),
                      400, "exceeds")


@pytest.mark.parametrize("case, words", [
    ("out_of_vocab", ["datum 0", "vocab"]),
    ("unknown_loss", ["no_such_loss"]),
    ("unknown_model", ["sess-nope:train:0"]),
    ("missing_input", ["datum 0", "advantages"]),
])
def test_semantic_errors_are_user_failed_futures(http, model_id, case, words):
    seq = {"out_of_vocab": 1, "unknown_loss": 2, "unknown_model": 1, "missing_input": 3}[case]
    if case == "out_of_vocab":
        msg = fb_body(model_id, seq, data=[sft_datum([1, 2, 9000, 3])])
    elif case == "unknown_loss":
        msg = fb_body(model_id, seq, loss_fn="no_such_loss")
    elif case == "unknown_model":
        msg = fb_body("sess-nope:train:0", seq)
    else:
        d = types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                        loss_fn_inputs={"target_tokens": [2, 3], "logprobs": [-1.0, -1.0]})
        msg = fb_body(model_id, seq, data=[d], loss_fn="importance_sampling")
    r = http.post("/forward_backward", content=msg.SerializeToString(), headers=PROTO)
    if r.status_code != 200:  # rejected at submission: must still be a 4xx with a JSON body
        assert_json_error(r, r.status_code, *words)
        assert 400 <= r.status_code < 500
        return
    failed = outcome(http, r.json()["request_id"])
    assert failed["category"] == "user", failed
    assert all(w.lower() in failed["error"].lower() for w in words), failed["error"]


def test_unknown_base_model_and_ids(http, ember_server):
    session = http.post("/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "x"}).json()
    r = http.post("/create_model", json={"session_id": session["session_id"], "model_seq_id": 0,
                                         "base_model": "no/such-model", "lora_config": {"rank": 2}})
    if r.status_code == 200:
        failed = outcome(http, r.json()["request_id"])
        assert failed["category"] == "user" and "no/such-model" in failed["error"]
    else:
        assert_json_error(r, r.status_code, "no/such-model")
    assert_json_error(http.post("/retrieve_future", json={"request_id": "req-nope"}), 404)
    assert_json_error(http.post("/get_info", json={"model_id": "sess-nope:train:0"}), 404)
    assert_json_error(http.get("/samplers/nope"), 404)
    assert_json_error(http.post("/no_such_endpoint", json={}), 404)
    assert_json_error(httpx.post(ember_server.base_url + "/api/v1/create_session", json={}), 401, "API key")


def test_the_server_keeps_serving(ember_server):
    assert ember_server.alive()
    sc = tinker.ServiceClient(base_url=ember_server.base_url, api_key=API_KEY)
    try:
        tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
        out = tc.forward_backward([sft_datum([5, 6, 7, 8])], "cross_entropy").result()
        assert np.isfinite(out.metrics["loss:sum"])
        tc.optim_step(types.AdamParams()).result()
    finally:
        sc.close("success").result(timeout=30)
