"""Issue 24's small hostile requests, replayed against a real `ember serve` whose address
space is capped (`prlimit --as`): each is refused as a user error (HTTP 400 or a failed
future with category "user") naming what was wrong, before the server allocates, stores
or blocks on what it asked for, and `/healthz` keeps answering while the heavy ones run.

* item 2: a 114-byte forward whose sparse `target_tokens` declares [1, 67108864];
  top-K targets with more columns than the vocabulary; results over `max_result_bytes`.
* item 3: the 152-byte chat request (n=256, top_logprobs=100) and heavy OpenAI answers
  built off the event loop.
* item 6: unbounded `user_metadata`; a 47 MB JSON body parsed or refused off the loop.
* item 8: lone surrogates and deep nesting on every JSON route.
* item 9: checkpoint names with a trailing newline.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from fastapi.routing import APIRoute
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from ember.server import routes_unsupported
from ember.server.app import create_app
from ember.server.config import ServerConfig
from helpers.server import API_KEY, MODEL_NAME, ServerProc, future_outcome, memory_cap, sft_datum, start_server

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

MEMORY_CAP_BYTES = 4 * 1024**3  # torch maps ~1.6 GB at rest; the 6.4 GB attack must fail inside it
HEALTHZ_BOUND_S = 0.5  # issue 24: /healthz answers within 0.5 s during each heavy request
PROTO = {"Content-Type": "application/x-protobuf"}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[ServerProc]:
    """Default limits and body limit (64 MB), as the issue's attacks met them."""
    proc = start_server(Path(tiny_model_dir), tmp_path_factory.mktemp("hostile"), wrap=memory_cap(MEMORY_CAP_BYTES))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers={"X-API-Key": API_KEY}, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def sc(server):
    client = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    yield client
    client.close("success").result(timeout=60)


def fresh_run(sc) -> str:
    """A run that only raw requests use (their seq_ids start at 1)."""
    return sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).get_info().model_id


def vocab_size(model_dir) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


def user_error(resp: httpx.Response, *words: str) -> str:
    """The message of a 400 in either error shape (Tinker's or OpenAI's), checked for `words`."""
    assert resp.status_code == 400, (resp.status_code, resp.text[:500])
    body = resp.json()
    message = body["error"]["message"] if isinstance(body["error"], dict) else body["error"]
    if not isinstance(body["error"], dict):
        assert body["category"] == "user", body
    for word in words:
        assert word.lower() in message.lower(), message
    return message


def outcome(http: httpx.Client, request_id: str) -> dict:
    return future_outcome(http, request_id, 300, path="/api/v1/retrieve_future")


@contextmanager
def healthz_watch(base_url: str) -> Iterator[list[float]]:
    """Poll /healthz from another thread while the block runs; yields its latencies.

    Empty when the request ended before the next poll began (a poll in flight is always
    counted: the thread is joined), so callers take `max(latencies, default=0.0)`."""
    latencies: list[float] = []
    done, polled = threading.Event(), threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=300) as client:
            while True:
                t0 = time.perf_counter()
                client.get(base_url + "/api/v1/healthz").raise_for_status()
                latencies.append(time.perf_counter() - t0)
                polled.set()
                if done.wait(0.05):
                    return

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    assert polled.wait(60), "healthz never answered"
    latencies.clear()  # the connection's first poll is not the request's
    try:
        yield latencies
    finally:
        done.set()
        thread.join(300)


def sparse_forward(model_id: str, seq_id: int, shape: list[int], loss_fn: str = "cross_entropy") -> bytes:
    """A forward of one 1-token datum whose `target_tokens` is an empty sparse CSR tensor."""
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=loss_fn, forward_only=True)
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([1] * shape[0], "<i4").tobytes()
    target = datum.loss_fn_inputs["target_tokens"]
    target.dtype = pb.DTYPE_INT64
    target.shape.extend(shape)
    target.sparse_csr.crow_indices = np.zeros(shape[0] + 1, "<i8").tobytes()
    return msg.SerializeToString()


# ---------------------------------------------------------------------------------------
# item 2: sizes before work
# ---------------------------------------------------------------------------------------


def test_the_114_byte_sparse_forward_is_refused_before_allocation(server, http, sc):
    body = sparse_forward(fresh_run(sc), 1, [1, 67108864])
    assert len(body) < 200  # the attack's own size (its model id is a little longer here)
    message = user_error(http.post("/api/v1/forward_backward", content=body, headers=PROTO),
                         "target_tokens", "[1, 67108864]", "bytes", "limit")
    assert "67108864" in message
    assert server.alive()


def test_top_k_wider_than_the_vocabulary_is_a_user_error(http, sc, tiny_model_dir):
    vocab = vocab_size(tiny_model_dir)
    r = http.post("/api/v1/forward_backward", content=sparse_forward(fresh_run(sc), 1, [1, vocab + 1]),
                  headers=PROTO)
    assert r.status_code == 200, r.text
    failed = outcome(http, r.json()["request_id"])
    assert failed.get("category") == "user", failed
    assert f"K={vocab + 1}" in failed["error"] and f"vocab_size={vocab}" in failed["error"], failed


def test_a_result_over_max_result_bytes_is_refused_not_stored(tiny_model_dir, tmp_path_factory):
    proc = start_server(Path(tiny_model_dir), tmp_path_factory.mktemp("small-results"),
                        wrap=memory_cap(MEMORY_CAP_BYTES),
                        extra_args=["--limits.max_result_bytes", "20000",
                                    "--limits.max_openai_response_bytes", "20000"])
    sc = tinker.ServiceClient(base_url=proc.base_url, api_key=API_KEY)
    try:
        tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2)
        small = tc.forward([sft_datum([1, 2, 3, 4])], "cross_entropy").result(timeout=120)
        assert len(small.loss_fn_outputs) == 1  # an ordinary result is stored and returned
        big = types.Datum(model_input=types.ModelInput.from_ints([1] * 200),  # (200, 40) top-K logprobs: 32 kB
                          loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(np.ones((200, 40), np.int64))})
        with pytest.raises(Exception, match="max_result_bytes=20000"):
            tc.forward([big], "cross_entropy").result(timeout=120)
        answers = [e["response"] for e in proc.requests("/retrieve_future") if isinstance(e["response"], dict)]
        refused = [a for a in answers if "max_result_bytes" in a.get("error", "")]
        assert refused and all(a["category"] == "user" for a in refused), answers
        # the OpenAI answer has a bound of its own
        with httpx.Client(base_url=proc.base_url, headers={"X-API-Key": API_KEY}, timeout=300) as http:
            r = http.post("/v1/chat/completions", json={
                "model": MODEL_NAME, "messages": [{"role": "user", "content": "a"}], "max_tokens": 40,
                "n": 4, "logprobs": True, "top_logprobs": 5})
            user_error(r, "max_openai_response_bytes=20000")
    finally:
        sc.close("success").result(timeout=60)
        proc.stop()


# ---------------------------------------------------------------------------------------
# item 3: OpenAI answers off the event loop, bounded
# ---------------------------------------------------------------------------------------

ATTACK_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "a"}], "max_tokens": 1015,
               "temperature": 0, "n": 256, "logprobs": True, "top_logprobs": 100}


def test_the_152_byte_chat_request_is_refused_at_once(server, http):
    with healthz_watch(server.base_url) as latencies:
        t0 = time.perf_counter()
        message = user_error(http.post("/v1/chat/completions", json=ATTACK_CHAT), "n", "max_openai_n")
        took = time.perf_counter() - t0
    assert took < 30, took  # refused before sampling (the old server sampled 256 x 1015 tokens)
    assert max(latencies, default=0.0) < HEALTHZ_BOUND_S, (latencies, message)  # none: refused within 50 ms
    # each bound on its own
    user_error(http.post("/v1/chat/completions", json={**ATTACK_CHAT, "n": 1}), "top_logprobs", "20")
    user_error(http.post("/v1/chat/completions", json={**ATTACK_CHAT, "n": 16, "top_logprobs": 20}),
               "max_openai_logprob_entries")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_heavy_openai_answer_does_not_stall_the_event_loop(server, http, path):
    """16 x 400 tokens with 20 top logprobs each (134,400 entries, ~8 MB of JSON): allowed,
    and built off the loop. On 2886dd3 /healthz waited 6.5 s for this chat answer."""
    common = {"model": MODEL_NAME, "max_tokens": 400, "temperature": 0, "n": 16}
    body = ({**common, "messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 20}
            if "chat" in path else {**common, "prompt": "a", "logprobs": 20})
    warm = http.post(path, json={**body, "n": 1, "max_tokens": 2})  # the sampler's first load is not measured
    assert warm.status_code == 200, warm.text[:300]
    with healthz_watch(server.base_url) as latencies:
        t0 = time.perf_counter()
        r = http.post(path, json=body)
        took = time.perf_counter() - t0
    assert r.status_code == 200, r.text[:500]
    choices = r.json()["choices"]
    assert len(choices) == 16
    entries = (choices[0]["logprobs"]["content"] if "chat" in path else choices[0]["logprobs"]["top_logprobs"])
    assert len(entries) == r.json()["usage"]["completion_tokens"] // 16 > 0
    # watched throughout (not a duration bound, which a fast machine fails: 1.5 s there)
    assert len(latencies) >= 3, f"healthz answered {len(latencies)} times during a {took:.2f} s request"
    assert max(latencies) < HEALTHZ_BOUND_S, f"healthz took {max(latencies):.2f} s during a {took:.1f} s request"


# ---------------------------------------------------------------------------------------
# item 6: user_metadata bounded; big bodies parsed or refused off the loop
# ---------------------------------------------------------------------------------------

METADATA_CASES = {
    "bytes": ({"k": "x" * 70_000}, "max_metadata_bytes"),
    "keys": ({f"k{i}": "v" for i in range(1025)}, "max_metadata_keys"),
    "depth": ({"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {"i": 1}}}}}}}}}, "max_metadata_depth"),
}


@pytest.mark.parametrize("case", sorted(METADATA_CASES))
def test_session_and_run_metadata_are_bounded(http, sc, case):
    meta, limit = METADATA_CASES[case]
    user_error(http.post("/api/v1/create_session", json={"tags": [], "user_metadata": meta, "sdk_version": "x"}),
               "user_metadata", limit)
    session = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "x"}).json()
    r = http.post("/api/v1/create_model", json={"session_id": session["session_id"], "model_seq_id": 0,
                                                "base_model": MODEL_NAME, "lora_config": {"rank": 2},
                                                "user_metadata": meta})
    failed = outcome(http, r.json()["request_id"]) if r.status_code == 200 else {"category": "user",
                                                                                 "error": user_error(r)}
    assert failed.get("category") == "user" and limit in failed["error"], failed
    listed = http.get("/api/v1/training_runs", params={"limit": 3})
    assert listed.status_code == 200 and len(listed.content) < 100_000


def _events(n: int) -> bytes:
    return b'{"events":[' + b",".join([b'{"event":"x","n":1}'] * n) + b"]}"


def _string_event(n: int) -> bytes:
    return b'{"events":[{"event":"' + b"x" * n + b'"}]}'


BIG_BODIES = {  # path, body, what refuses it (None: accepted)
    "47_mb_of_small_values": ("/api/v1/telemetry", lambda: _events(47 * 1024 * 1024 // 20), "max_json_body_bytes"),
    "47_mb_string": ("/api/v1/telemetry", lambda: _string_event(47 * 1024 * 1024), "max_json_body_bytes"),
    "3m_key_session": ("/api/v1/create_session", lambda: b'{"tags":[],"sdk_version":"x","user_metadata":{'
                       + b",".join(b'"k%d":1' % i for i in range(3_000_000)) + b"}}", "max_json_body_bytes"),
    "2m_values_in_15_mb": ("/api/v1/telemetry", lambda: _events(15 * 1024 * 1024 // 20), "max_json_values"),
    "12_mb_string": ("/api/v1/telemetry", lambda: _string_event(12 * 1024 * 1024), None),
}


@pytest.mark.parametrize("case", list(BIG_BODIES))
def test_healthz_answers_while_a_big_json_body_is_handled(server, http, case):
    """Refused before parsing (by size, then by the values its bytes can hold), or parsed
    in the thread pool; never on the event loop (2886dd3: 3 s for a 47 MB /telemetry)."""
    path, make, refused_by = BIG_BODIES[case]
    body = make()
    with healthz_watch(server.base_url) as latencies:
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    if refused_by is None:
        assert r.status_code == 200, r.text[:300]
    else:
        assert r.status_code in (400, 413) and refused_by in r.text, (r.status_code, r.text[:300])
    assert max(latencies, default=0.0) < HEALTHZ_BOUND_S, f"healthz took {max(latencies, default=0.0):.2f} s"


@pytest.mark.parametrize("field", [b"\x0a\x00", b"\x1a\x00"], ids=["model_id", "datum"])
def test_healthz_answers_while_a_47_mb_protobuf_is_refused(server, http, field):
    """23 million two-byte fields (a model_id or an empty datum each): counted, not parsed."""
    body = field * (47 * 1024 * 1024 // 2)
    with healthz_watch(server.base_url) as latencies:
        user_error(http.post("/api/v1/forward_backward", content=body, headers=PROTO), "max_protobuf_fields")
    assert max(latencies, default=0.0) < HEALTHZ_BOUND_S, f"healthz took {max(latencies, default=0.0):.2f} s"


# ---------------------------------------------------------------------------------------
# item 8: lone surrogates and deep nesting are 400s naming the field, on every JSON route
# ---------------------------------------------------------------------------------------


def json_routes() -> list[tuple[str, str]]:
    """(method, path) of every route that reads a JSON body, path parameters filled in."""
    app = create_app(None, ServerConfig(api_keys={API_KEY: "x"}))
    no_body = {"/api/v1" + p for _, p, _ in routes_unsupported.ENDPOINTS}  # answered 404 without reading
    out = []
    for route in app.routes:
        if not isinstance(route, APIRoute) or not route.path.startswith(("/api/v1/", "/v1/")):
            continue  # the console's pages take forms, not JSON (tests/server/test_server_console.py)
        if route.path in no_body or route.path.endswith(("/publish", "/forward_backward")):
            continue
        if route.path.startswith("/api/v1/admin/"):
            continue  # the operator's actions read no body, only the path (tests/server/test_server_admin.py)
        for method in sorted(route.methods & {"POST", "PUT"}):
            out.append((method, route.path.replace("{run_id}", "r").replace("{checkpoint_id:path}", "weights/c")
                        .replace("{session_id}", "s")))
    return out


JSON_ROUTES = json_routes()


def test_every_json_route_is_covered():
    assert len(JSON_ROUTES) >= 15, JSON_ROUTES


def test_the_issue_surrogate_request(http):
    r = http.post("/api/v1/retrieve_future", content=b'{"request_id":"\\udcff"}')
    user_error(r, "request_id", "surrogate")


@pytest.mark.parametrize("method, path", JSON_ROUTES)
def test_lone_surrogates_and_deep_nesting_are_400s(server, http, method, path):
    field = "detail" if path.endswith("/finish") else "ttl_seconds" if path.endswith("/ttl") else "model_id"
    for raw, words in [
        (b'{"%s":"ok\\udcff"}' % field.encode(), [field, "surrogate"]),
        (b'{"x\\ud800y":1}', ["surrogate"]),
        (b"[" * 1000 + b"]" * 1000, ["nested deeper"]),  # 2 kB
        (b'{"%s":' % field.encode() + b"[" * 5000 + b"]" * 5000 + b"}", [field, "nested deeper"]),
        (b'{"%s":' % field.encode() + b"[" * 100 + b"]" * 100 + b"}", [field, "nested deeper"]),
    ]:
        r = http.request(method, path, content=raw, headers={"Content-Type": "application/json"})
        user_error(r, *words)
    assert server.alive()


OPENAI_SURROGATES = [
    ("/v1/completions", {"prompt": "a\udcff"}, "prompt"),
    ("/v1/completions", {"prompt": ["a\udcff"]}, "prompt[0]"),
    ("/v1/completions", {"prompt": "a", "stop": ["\udcff"]}, "stop[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udcff"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udcff"}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": [{"role": "\udcff", "content": "a"}]}, "messages[0].role"),
]


@pytest.mark.parametrize("path, body, field", OPENAI_SURROGATES, ids=[c[2] for c in OPENAI_SURROGATES])
def test_openai_surrogates_are_400s(http, path, body, field):
    raw = json.dumps({"model": MODEL_NAME, "max_tokens": 2, **body}).encode()  # json.dumps escapes them
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    message = user_error(r, "surrogate")
    assert f"body.{field}:" in message, message


# ---------------------------------------------------------------------------------------
# item 9: names are matched whole
# ---------------------------------------------------------------------------------------


def test_a_checkpoint_name_with_a_trailing_newline_is_refused(sc):
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2)
    tc.save_state("ok").result(timeout=120)
    with pytest.raises(Exception, match="invalid checkpoint name"):
        tc.save_state("ok\n").result(timeout=120)
    run_id = tc.get_info().model_id
    names = [c.checkpoint_id for c in sc.create_rest_client().list_checkpoints(run_id).result().checkpoints]
    assert names == ["weights/ok"], names
