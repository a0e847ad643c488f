"""Attacks as tests: schema- and property-based fuzzing of the HTTP server.

Hostile input goes to one real `ember serve` subprocess whose address space is capped
(`prlimit --as`), so a runaway allocation is a MemoryError in the server, not a host out
of memory:

* schemathesis: every operation of the app's OpenAPI schema (paths and parameters from
  FastAPI, request bodies from the SDK's own request types), valid and invalid cases;
* hypothesis: valid create_model / asample JSON bodies and forward_backward protobuf
  bodies with fields mutated (wrong types, missing, NaN/inf, negative and huge counts,
  seq_ids far ahead), truncated or corrupted protobuf and random bytes;
* hypothesis: image chunks in sample prompts (sizes up to 4096 x 4096 and headers claiming
  more, modes, format labels, truncation, flipped bytes, counts past the limits), with
  the server's peak RSS bounded (issue 43);
* hypothesis: every console page (GET and POST), signed in and not, with hostile path
  segments, `//host` prefixes, query values and form fields; every `Location` stays
  ASCII and same-origin (issue 43);
* a client that hangs up in the middle of a retrieve_future long-poll.

The pass criterion is `assert_server_healthy`: no 5xx answer (seen by the client or in
the server's request log), no traceback in the server's stderr, and the official SDK
still trains and samples. `test_the_check_catches_a_faulty_route` shows that it can fail.
Everything is seeded (`derandomize=True`) and no hypothesis database is written.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import io
import json
import math
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

import httpx
import numpy as np
import pytest
import schemathesis
import tinker
import zstandard
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from ember.server import requests as rq
from ember.server import openai_compat as oa
from ember.server import routes_unsupported
from ember.server.app import create_app
from ember.server.console.routes import router as console_router
from ember.server.config import ServerConfig
from helpers.server import API_KEY, MODEL_NAME, ServerProc, memory_cap, sft_datum, start_server, wait_until

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

# Torch on CPU maps ~1.6 GB at rest and the thread pool adds stacks and malloc arenas;
# 4 GiB serves normally and stops a runaway count long before it hurts the shared host.
MEMORY_CAP_BYTES = 4 * 1024**3
SCHEMA_EXAMPLES = 20  # per operation and generation mode (positive, negative)
BODY_EXAMPLES = 150  # per mutated-body test
LONG_POLL_S = 5.0
# A refused forward_backward leaves a hole in its run's seq_ids that the run waits out
# before the next request; short, so draining the fuzzed futures stays quick.
SEQ_GAP_S = 2.0
AUTH = {"X-API-Key": API_KEY}
PROTO = "application/x-protobuf"
FUZZ_SETTINGS = settings(
    max_examples=BODY_EXAMPLES, derandomize=True, database=None, deadline=None,
    phases=[Phase.explicit, Phase.generate],  # shrinking would replay hostile inputs for minutes
    suppress_health_check=list(HealthCheck),
)


# ---------------------------------------------------------------------------------------
# The check every fuzz test ends with
# ---------------------------------------------------------------------------------------


def new_connection_per_request() -> httpx.Client:
    """What `httpx.post` does per call (a fresh connection each request), without what it
    also does per call: build a client and its TLS context, ~50 ms of CPU, which was most of
    the fuzz tests' client-side time over their ~1,500 requests."""
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


@dataclass
class Fuzzed:
    """A server under attack, the 5xx answers its attackers saw, and how much of its
    request log and stderr earlier checks have already judged (each test reports its own)."""

    server: ServerProc
    http: httpx.Client = field(default_factory=new_connection_per_request)
    server_errors: list[str] = field(default_factory=list)
    log_seen: int = 0
    stderr_seen: int = 0
    attacked: set[tuple[str, str]] = field(default_factory=set)  # schemathesis operations run against it

    def saw(self, method: str, path: str, response: httpx.Response | Any, sent: Any = None) -> None:
        if response.status_code >= 500:
            self.server_errors.append(f"{method} {path} -> {response.status_code} {response.text[:300]!r}"
                                      f" for {str(sent)[:300]}")


def server_problems(fuzzed: Fuzzed) -> list[str]:
    """What shows a server fault since the last call: 5xx answers seen by a client, 5xx or
    unanswered requests in the request log, a traceback in stderr, a dead server."""
    server = fuzzed.server
    problems, fuzzed.server_errors = fuzzed.server_errors, []
    entries = server.requests()
    for entry in entries[fuzzed.log_seen:]:
        if entry.get("status", 500) >= 500:
            problems.append(f"request log: {entry['method']} {entry['path']} -> {entry.get('status', 'no answer')}")
    stderr = server.stderr_path.read_text()
    new_stderr = stderr[fuzzed.stderr_seen:]
    if "Traceback" in new_stderr:
        problems.append("traceback in the server's stderr:\n" + new_stderr[new_stderr.index("Traceback"):][:3000])
    fuzzed.log_seen, fuzzed.stderr_seen = len(entries), len(stderr)
    if not server.alive():
        problems.append(f"the server exited with {server.proc.returncode}")
    return problems


def sdk_step(server: ServerProc) -> None:
    """The official SDK still works: a LoRA client trains a step and samples."""
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    try:
        tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result(timeout=60)
        out = tc.forward_backward([sft_datum([5, 6, 7, 8])], "cross_entropy").result(timeout=60)
        assert np.isfinite(out.metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)
        sampler = tc.save_weights_and_get_sampling_client("fuzz-check").result(timeout=60)
        prompt = types.ModelInput.from_ints([1, 2, 3])
        resp = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=3)).result(timeout=60)
        assert len(resp.sequences) == 1 and resp.sequences[0].tokens
    finally:
        sc.close("success").result(timeout=30)


def assert_server_healthy(fuzzed: Fuzzed) -> None:
    problems = server_problems(fuzzed)
    assert not problems, "\n".join(problems)  # before the SDK step: the SDK retries 5xx for minutes
    sdk_step(fuzzed.server)
    problems = server_problems(fuzzed)
    assert not problems, "\n".join(problems)


def start_fuzz_server(model_dir: Path, workdir: Path, script: Path | None = None) -> ServerProc:
    return start_server(Path(model_dir), workdir, script=script, wrap=memory_cap(MEMORY_CAP_BYTES),
                        # info: the one line a hung-up client earns is visible
                        extra_args=["--max-body-mb", "4", "--long-poll-s", str(LONG_POLL_S),
                                    "--seq-gap-timeout-s", str(SEQ_GAP_S), "--log-level", "info",
                                    # every case creates runs and sessions under one key: the
                                    # per-key quotas (tested in test_server_quotas.py) raised
                                    "--limits.max_runs_per_key", "100000", "--limits.max_sessions_per_key", "100000",
                                    "--limits.max_sampling_sessions_per_key", "100000"])


@pytest.fixture(scope="module")
def fuzz(tiny_model_dir, tmp_path_factory):
    server = start_fuzz_server(tiny_model_dir, tmp_path_factory.mktemp("fuzz-serve"))
    fuzzed = Fuzzed(server)
    yield fuzzed
    fuzzed.http.close()
    server.stop()


# ---------------------------------------------------------------------------------------
# schemathesis: every operation of the app's schema
# ---------------------------------------------------------------------------------------

# FastAPI cannot see the bodies (routes read them by hand so unknown fields are ignored),
# so the schema gets them from the same SDK types the routes validate with.
BODY_MODELS = {
    "/api/v1/client/config": rq.ClientConfigRequest,
    "/api/v1/client/dynamic_config": rq.ClientConfigRequest,
    "/api/v1/create_session": rq.CreateSessionRequest,
    "/api/v1/session_heartbeat": rq.SessionHeartbeatRequest,
    "/api/v1/sessions/{session_id}/finish": rq.FinishSessionRequest,
    "/api/v1/telemetry": rq.TelemetryRequest,
    "/api/v1/create_model": rq.CreateModelRequest,
    "/api/v1/get_info": rq.GetInfoRequest,
    "/api/v1/optim_step": rq.OptimStepRequest,
    "/api/v1/save_weights": rq.SaveWeightsRequest,
    "/api/v1/load_weights": rq.LoadWeightsRequest,
    "/api/v1/save_weights_for_sampler": rq.SaveWeightsForSamplerRequest,
    "/api/v1/save_weights_external": rq.SaveWeightsExternalRequest,
    "/api/v1/create_sampling_session": rq.CreateSamplingSessionRequest,
    "/api/v1/asample": rq.SampleRequest,
    "/api/v1/retrieve_future": rq.FutureRetrieveRequest,
    "/api/v1/weights_info": rq.WeightsInfoRequest,
    "/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}/access_token": rq.WeightsAccessTokenRequest,
    "/v1/completions": oa.CompletionRequest,
    "/v1/chat/completions": oa.ChatRequest,
}
PROTOBUF_BODIES = {"/api/v1/forward_backward"}
# Calls ember answers "not supported" (404 with the reason) take no body, nor does publish.
NO_BODY = {"/api/v1" + path.replace(":path", "") for verb, path, _ in routes_unsupported.ENDPOINTS if verb == "POST"}
NO_BODY |= {"/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}/publish"}

schemathesis.serializer.alias(PROTO, "application/octet-stream")  # raw bytes, as generated


def _base64_bytes(node: Any) -> Any:
    """pydantic's `bytes` is `format: binary`; in a JSON body it travels as base64 text."""
    if isinstance(node, dict):
        return {k: "byte" if k == "format" and v == "binary" else _base64_bytes(v) for k, v in node.items()}
    return [_base64_bytes(v) for v in node] if isinstance(node, list) else node


def openapi_schema() -> dict:
    """The app's own OpenAPI document with the request bodies filled in."""
    schema = create_app(None, ServerConfig(api_keys={API_KEY: "fuzz"})).openapi()
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, item in schema["paths"].items():
        if "post" not in item or path in NO_BODY:
            continue
        if path in PROTOBUF_BODIES:
            content = {PROTO: {"schema": {"type": "string", "format": "binary"}}}
        else:
            body = _base64_bytes(BODY_MODELS[path].model_json_schema(ref_template="#/components/schemas/{model}"))
            components.update(body.pop("$defs", {}))
            content = {"application/json": {"schema": body}}
        item["post"]["requestBody"] = {"required": True, "content": content}
    return schema


SCHEMA = schemathesis.openapi.from_dict(openapi_schema())
OPERATIONS = [(path, method.upper()) for path, item in SCHEMA.raw_schema["paths"].items() for method in item]


def test_every_post_route_has_a_body_schema():
    posts = {p for p, m in OPERATIONS if m == "POST"}
    assert posts == set(BODY_MODELS) | PROTOBUF_BODIES | NO_BODY


ANY_STRING = ({"type": "string"}, {"type": "string", "format": "binary"})


def only_free_form_strings(path: str, method: str) -> bool:
    """Whether every input of the operation (parameters and body) is an unconstrained string:
    a URL path segment or a raw body is a string whatever it holds, so no invalid input
    exists. schemathesis's negative mode then draws for seconds of CPU and raises
    Unsatisfiable without sending a request; `run_schemathesis` skips that search
    (`test_free_form_operations_have_no_invalid_input` shows it is empty)."""
    op = SCHEMA.raw_schema["paths"][path][method.lower()]
    schemas = [p.get("schema", {}) for p in op.get("parameters", [])]
    schemas += [c.get("schema", {}) for c in op.get("requestBody", {}).get("content", {}).values()]
    return all({k: v for k, v in s.items() if k not in ("title", "description")} in ANY_STRING for s in schemas)


def run_schemathesis(fuzzed: Fuzzed, path: str, method: str, max_examples: int = SCHEMA_EXAMPLES,
                     modes: tuple[GenerationMode, ...] = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)) -> None:
    operation = SCHEMA[path][method]
    if only_free_form_strings(path, method):
        modes = tuple(m for m in modes if m != GenerationMode.NEGATIVE)
    for mode in modes:

        @settings(FUZZ_SETTINGS, max_examples=max_examples)
        @given(case=operation.as_strategy(generation_mode=mode))
        def attack(case):
            response = case.call(base_url=fuzzed.server.base_url, headers=AUTH, timeout=LONG_POLL_S + 30)
            fuzzed.saw(method, case.formatted_path, response, case.body)

        try:
            attack()
        except Unsatisfiable:
            # Only free-form strings in, e.g. GET /sessions/{session_id}: no invalid input exists.
            assert mode == GenerationMode.NEGATIVE
    fuzzed.attacked.add((path, method))


FREE_FORM = [("/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}/ttl", "PUT"),  # two path strings
             ("/api/v1/forward_backward", "POST")]  # a raw protobuf body


@pytest.mark.parametrize("path, method", FREE_FORM, ids=[f"{m} {p}" for p, m in FREE_FORM])
def test_free_form_operations_have_no_invalid_input(path, method):
    """What lets `run_schemathesis` skip the negative mode of such operations: schemathesis
    finds no invalid case (it would be sent to a closed port, failing the test)."""
    assert only_free_form_strings(path, method)
    operation = SCHEMA[path][method]

    @settings(FUZZ_SETTINGS, max_examples=SCHEMA_EXAMPLES)
    @given(case=operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    def attack(case):
        case.call(base_url="http://127.0.0.1:9", headers=AUTH, timeout=5)

    with pytest.raises(Unsatisfiable):
        attack()


@pytest.mark.parametrize("path, method", OPERATIONS, ids=[f"{m} {p}" for p, m in OPERATIONS])
def test_schemathesis_operation(fuzz, path, method):
    run_schemathesis(fuzz, path, method)
    problems = server_problems(fuzz)
    assert not problems, "\n".join(problems)


@pytest.fixture
def attacked_by_schemathesis(fuzz) -> Fuzzed:
    """The fuzzed server after every schemathesis operation: those the tests above have not
    run against it yet (all of them when the check below runs alone) are run here."""
    for path, method in OPERATIONS:
        if (path, method) not in fuzz.attacked:
            run_schemathesis(fuzz, path, method)
    return fuzz


def test_healthy_after_schemathesis(attacked_by_schemathesis):
    fuzz = attacked_by_schemathesis
    assert_server_healthy(fuzz)


# ---------------------------------------------------------------------------------------
# hypothesis: valid bodies, mutated
# ---------------------------------------------------------------------------------------


@dataclass
class Targets:
    """Real ids, so mutated bodies get past the lookups into the deep code."""

    session_id: str
    model_id: str
    sampling_session_id: str


@pytest.fixture(scope="module")
def targets(fuzz):
    sc = tinker.ServiceClient(base_url=fuzz.server.base_url, api_key=API_KEY)
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result(timeout=60)
    model_id = tc.get_info().model_id
    session_id = model_id.split(":train:")[0]
    r = fuzz.http.post(fuzz.server.base_url + "/api/v1/create_sampling_session", headers=AUTH, timeout=60,
                   json={"session_id": session_id, "sampling_session_seq_id": 1000, "base_model": MODEL_NAME})
    r.raise_for_status()
    yield Targets(session_id, model_id, r.json()["sampling_session_id"])
    sc.close("success").result(timeout=30)


def deep(levels: int, leaf: Any = 1) -> Any:
    for _ in range(levels):
        leaf = [leaf]
    return leaf


# Lone surrogates (JSON "\udcff": no UTF-8 encoding) and deep nesting: both were 500s (issue 24).
SURROGATES = ["\udcff", "a\ud800b", "\udfff" * 3]
DEEP = [deep(70), deep(300), {"a": deep(200)}]  # 1,000 deep goes as raw bytes (json.dumps recurses)

# What a hostile client puts in a field. The huge counts are for the size limits.
HOSTILE_VALUES = st.one_of(
    st.sampled_from([None, True, False, 0, -1, 1, 2**31 - 1, -(2**31), 2**63, 10**30, -(10**30),
                     math.nan, math.inf, -math.inf, 1e308, "", "x", "\x00", "ü" * 5, [], [None], {}, {"a": [1]},
                     *SURROGATES, *DEEP]),
    st.integers(), st.floats(), st.text(max_size=20),
)


def json_paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every position in a JSON document (dict keys and list indices), root excluded."""
    children = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    out: list[tuple] = []
    for key, value in children:
        out.append((*prefix, key))
        out.extend(json_paths(value, (*prefix, key)))
    return out


# Counts and ids where a bad number must be refused before anything is sized by it.
HOSTILE_COUNTS = st.sampled_from([-1, 0, 2**31 - 1, 2**63 - 1, 2**64, 10**12, 10**20]) | st.integers(-(2**70), 2**70)


@st.composite
def mutated_json(draw, base: dict, counts: tuple[tuple[str, ...], ...] = ()) -> Any:
    """`base` with one to three fields replaced, deleted or wrapped in a list, and maybe
    one of its `counts` (paths into it) set to a negative or huge number."""
    doc = copy.deepcopy(base)
    if counts and draw(st.booleans()):
        *parents, key = draw(st.sampled_from(counts))
        holder = doc
        for p in parents:
            holder = holder.setdefault(p, {})
        holder[key] = draw(HOSTILE_COUNTS)
        if draw(st.booleans()):
            return doc
    for _ in range(draw(st.integers(1, 3))):
        paths = json_paths(doc)
        if not paths:
            break
        *parents, key = draw(st.sampled_from(paths))
        holder = doc
        for p in parents:
            holder = holder[p]
        action = draw(st.sampled_from(["replace", "replace", "delete", "wrap"]))
        if action == "delete" and isinstance(holder, dict):
            del holder[key]
        elif action == "wrap":
            holder[key] = [holder[key]]
        else:  # a copy: a later step may mutate inside it, and DEEP's values are shared
            holder[key] = copy.deepcopy(draw(HOSTILE_VALUES))
    return doc


def post_json(fuzzed: Fuzzed, path: str, doc: Any) -> httpx.Response:
    body = json.dumps(doc).encode()  # NaN/Infinity literals included: Python's json reads them
    r = fuzzed.http.post(fuzzed.server.base_url + "/api/v1" + path, content=body, timeout=60,
                   headers={**AUTH, "Content-Type": "application/json"})
    fuzzed.saw("POST", path, r, body)
    return r


def accepted_id(response: httpx.Response) -> str | None:
    if response.status_code == 200 and isinstance(body := response.json(), dict):
        return body.get("request_id")
    return None


def drain(fuzzed: Fuzzed, request_ids: list[str], timeout: float = 40.0) -> None:
    """Wait for the accepted futures, so their failures land in this test's stderr, and
    report any bad input that ended as a *server* fault (contract 6: it is the user's)."""
    def outcome(rid: str) -> tuple[dict] | None:  # (its answer,) once not `try_again` ({}: not a 200)
        r = fuzzed.http.post(fuzzed.server.base_url + "/api/v1/retrieve_future", json={"request_id": rid},
                             headers={**AUTH, "Accept": "application/json"}, timeout=LONG_POLL_S + 30)
        fuzzed.saw("POST", "/retrieve_future", r, rid)
        body = r.json() if r.status_code == 200 else {}
        return None if body.get("type") == "try_again" else (body,)

    until = time.monotonic() + timeout  # one budget for them all; one still pending then is not reported
    for rid in dict.fromkeys(request_ids):
        with contextlib.suppress(AssertionError):
            body, = wait_until(lambda: outcome(rid), max(until - time.monotonic(), 0), interval=0,
                               message=f"future {rid} to finish")
            if body.get("category") == "server" and "skipped" not in body.get("error", ""):
                fuzzed.server_errors.append(f"future {rid} failed as a server fault: {body['error'][:300]}")


LISTINGS = ["/sessions", "/training_runs", "/checkpoints"]


@pytest.mark.parametrize("path", LISTINGS)
def test_hostile_pagination(fuzz, path):
    """schemathesis keeps integers small; page counters beyond 64 bits are where the
    database's integers end."""
    numbers = HOSTILE_COUNTS | st.text(max_size=8)

    @settings(FUZZ_SETTINGS, max_examples=25)
    @given(limit=numbers, offset=numbers)
    def attack(limit, offset):
        r = fuzz.http.get(fuzz.server.base_url + "/api/v1" + path, params={"limit": limit, "offset": offset},
                      headers=AUTH, timeout=30)
        fuzz.saw("GET", path, r, {"limit": limit, "offset": offset})

    attack()
    problems = server_problems(fuzz)
    assert not problems, "\n".join(problems)


def create_model_body(t: Targets, model_seq_id: int) -> dict:
    return types.CreateModelRequest(session_id=t.session_id, model_seq_id=model_seq_id, base_model=MODEL_NAME,
                                    lora_config=types.LoraConfig(rank=2)).model_dump(mode="json", exclude_none=True)


def sample_body(t: Targets, seq_id: int) -> dict:
    req = types.SampleRequest(sampling_session_id=t.sampling_session_id, seq_id=seq_id, num_samples=2,
                              prompt=types.ModelInput.from_ints([1, 2, 3]), topk_prompt_logprobs=2,
                              sampling_params=types.SamplingParams(max_tokens=4, top_k=5, seed=1))
    return req.model_dump(mode="json", exclude_none=True)


CREATE_MODEL_COUNTS = (("model_seq_id",), ("lora_config", "rank"), ("lora_config", "seed"))
SAMPLE_COUNTS = (("num_samples",), ("seq_id",), ("topk_prompt_logprobs",), ("prompt_logprobs_last_n",),
                 ("sampling_params", "max_tokens"), ("sampling_params", "top_k"), ("sampling_params", "seed"))


def test_mutated_create_model(fuzz, targets):
    accepted: list[str] = []

    @FUZZ_SETTINGS
    @given(data=st.data())
    def attack(data):
        base = create_model_body(targets, 10 + len(accepted))  # a fresh model_seq_id: no idempotent replay
        if rid := accepted_id(post_json(fuzz, "/create_model", data.draw(mutated_json(base, CREATE_MODEL_COUNTS)))):
            accepted.append(rid)

    attack()
    drain(fuzz, accepted)
    assert_server_healthy(fuzz)


@pytest.mark.parametrize("path", ["/asample", "/sample"])  # the SDK's sample() posts to /asample
def test_mutated_sample(fuzz, targets, path):
    accepted: list[str] = []

    @FUZZ_SETTINGS
    @given(data=st.data())
    def attack(data):
        base = sample_body(targets, 10**5 * len(path) + len(accepted))  # fresh seq_id: no idempotent replay
        if rid := accepted_id(post_json(fuzz, path, data.draw(mutated_json(base, SAMPLE_COUNTS)))):
            accepted.append(rid)

    attack()
    drain(fuzz, accepted)
    assert_server_healthy(fuzz)


# ---------------------------------------------------------------------------------------
# hypothesis: image chunks (issue 43): dimensions, formats, truncation, counts
# ---------------------------------------------------------------------------------------

# the fuzzed server may reach this at its peak (torch at rest ~1.6 GB, the decoding budget,
# the parsers); its address space is capped at MEMORY_CAP_BYTES
RSS_BOUND = 3 * 1024**3


def server_peak_rss(server: ServerProc) -> int:
    """The server's peak resident set (VmHWM) so far, in bytes."""
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for pid {server.proc.pid}")


@st.composite
def image_bytes_drawn(draw) -> tuple[bytes, str]:
    """(bytes, format label): a real image of drawn size and mode, or a header claiming a
    drawn size, truncated or corrupted at a drawn place, under a drawn label."""
    from PIL import Image

    from helpers.images import png_claiming

    width, height = draw(st.integers(1, 4096)), draw(st.integers(1, 4096))
    kind = draw(st.sampled_from(["real", "real", "claiming", "huge_claim", "random"]))
    if kind == "real":
        mode, fmt = draw(st.sampled_from(["1", "L", "RGB", "RGBA"])), draw(st.sampled_from(["PNG", "JPEG"]))
        buf = io.BytesIO()
        Image.new(mode if fmt == "PNG" or mode in ("L", "RGB") else "RGB", (width, height)).save(buf, format=fmt)
        data = buf.getvalue()
    elif kind == "claiming":
        data = png_claiming(width, height, payload=draw(st.integers(0, 2000)))
    elif kind == "huge_claim":
        data = png_claiming(draw(st.integers(4097, 2**31 - 1)), draw(st.integers(1, 2**31 - 1)), payload=10)
    else:
        data = draw(st.binary(max_size=256))
    cut = draw(st.sampled_from(["whole", "whole", "truncated", "flipped"]))
    if cut == "truncated" and data:
        data = data[:draw(st.integers(0, len(data) - 1))]
    elif cut == "flipped" and data:
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]
    label = draw(st.sampled_from(["png", "jpeg", "png", "jpeg", "gif", "", "PNG"]))
    return data, label


@st.composite
def image_prompt(draw) -> dict:
    images = draw(st.lists(image_bytes_drawn(), min_size=0, max_size=6))
    chunks: list[dict] = [{"type": "encoded_text", "tokens": [1, 2]}]
    for data, label in images:
        expected = draw(st.sampled_from([None, 1, 4, 0, -1, 2**40]))
        chunks.append({"type": "image", "data": base64.b64encode(data).decode(), "format": label,
                       "expected_tokens": expected})
    if draw(st.booleans()):  # many copies of one image: the count and the pixel total
        chunks += chunks[-1:] * draw(st.integers(0, 1100))
    return {"chunks": chunks}


def test_hostile_image_chunks(fuzz, targets):
    """Image chunks of every drawn size, mode, format label, truncation and count in
    sample prompts: no 5xx, no traceback, and the server's peak RSS stays bounded."""
    accepted: list[str] = []

    @settings(FUZZ_SETTINGS, max_examples=80)
    @given(prompt=image_prompt())
    def attack(prompt):
        body = sample_body(targets, 3 * 10**5 + len(accepted))
        body["prompt"] = prompt
        if rid := accepted_id(post_json(fuzz, "/asample", body)):
            accepted.append(rid)

    start = time.monotonic()
    attack()
    drain(fuzz, accepted)
    assert time.monotonic() - start < 60
    problems = server_problems(fuzz)
    assert not problems, "\n".join(problems)
    assert server_peak_rss(fuzz.server) < RSS_BOUND


# ---------------------------------------------------------------------------------------
# hypothesis: the console's pages (issue 43): hostile paths, queries and forms
# ---------------------------------------------------------------------------------------

CONSOLE_ROUTES = sorted({(r.path, m) for r in console_router.routes for m in r.methods if m in ("GET", "POST")})
HOSTILE_TEXT = st.text(st.characters(codec="utf-8"), max_size=40) | st.sampled_from(
    ["\u202e", "\x00", "\r\nSet-Cookie: x=1", "//evil.example", "/\\evil.example", "\t/evil.example", "%ZZ",
     "x" * 5000, "..", "/"])


def console_target(template: str, values: list[str], prefix: str) -> str:
    """`template` with its path parameters filled with the percent-encoded `values`."""
    parts = iter(values)
    path = re.sub(r"\{[^}]+\}", lambda _: quote(next(parts, "x"), safe="") or "x", template)
    return prefix + path


def test_hostile_console_requests(fuzz):
    """Every console route, signed in and not: hostile path segments, `//host` prefixes,
    query values and form fields. No 5xx, and every `Location` is ASCII and same-origin."""
    r = httpx.post(fuzz.server.base_url + "/login", data={"api_key": API_KEY}, timeout=30)
    assert r.status_code == 303, r.text
    cookie = r.headers["set-cookie"].split(";")[0]
    origin = urlsplit(fuzz.server.base_url).netloc

    @settings(FUZZ_SETTINGS, max_examples=150)
    @given(route=st.sampled_from(CONSOLE_ROUTES), values=st.lists(HOSTILE_TEXT, min_size=2, max_size=2),
           prefix=st.sampled_from(["", "", "", "/", "//evil.example", "/%2F%2Fevil.example"]),
           query=st.dictionaries(st.sampled_from(["next", "mode", "checkpoint", "base_model", "offset", "metric"]),
                                 HOSTILE_TEXT, max_size=3),
           form=st.dictionaries(st.sampled_from(["api_key", "next", "csrf", "action", "ttl_seconds", "prompt",
                                                 "mode", "checkpoint", "max_tokens", "temperature", "seed"]),
                                HOSTILE_TEXT, max_size=5),
           signed_in=st.booleans())
    # the request first (explicit examples run before the drawn ones), then its kin
    @example(route=("/training_runs/{run_id}", "GET"), values=["\u202eabc", "x"], prefix="", query={}, form={},
             signed_in=False)
    @example(route=("/sessions/{session_id}", "GET"), values=["a\r\nSet-Cookie: x=1", "x"], prefix="", query={},
             form={}, signed_in=False)
    @example(route=("/checkpoints/{run_id}/{checkpoint_id}", "GET"), values=["\x00", "\u202e" * 3000], prefix="",
             query={}, form={}, signed_in=True)
    @example(route=("/login", "POST"), values=["x", "x"], prefix="", query={}, form={"api_key": API_KEY,
             "next": "/\u202e\t/evil.example"}, signed_in=False)
    def attack(route, values, prefix, query, form, signed_in):
        template, method = route
        url = fuzz.server.base_url + console_target(template, values, prefix)
        headers = {"Cookie": cookie} if signed_in else {}
        fuzz.http.cookies.clear()  # signed in by the Cookie header only (a sign-in example sets one)
        try:
            r = fuzz.http.request(method, url, params=query, data=form if method == "POST" else None,
                                  headers=headers, timeout=30)
        except httpx.InvalidURL:
            return  # a URL httpx will not send (the raw-socket test sends such bytes)
        fuzz.saw(method, url[:200], r, {"query": query, "form": form})
        loc = r.headers.get("location")
        if loc is not None and (not loc.isascii() or not loc.startswith("/") or loc.startswith("//")
                                or urlsplit(urljoin(url, loc)).netloc != origin):
            fuzz.server_errors.append(f"{method} {url[:200]} -> Location {loc[:200]!r}")

    start = time.monotonic()
    attack()
    assert time.monotonic() - start < 60
    problems = server_problems(fuzz)
    assert not problems, "\n".join(problems)
    assert server_peak_rss(fuzz.server) < RSS_BOUND


def test_mutated_optim_step(fuzz):
    """AdamW hyper-parameters (NaN, inf, negative, strings) and seq_ids, on a fresh run so
    every base body is the next seq_id in order."""
    sc = tinker.ServiceClient(base_url=fuzz.server.base_url, api_key=API_KEY)
    model_id = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result(timeout=60).get_info().model_id
    accepted: list[str] = []

    @FUZZ_SETTINGS
    @given(data=st.data())
    def attack(data):
        seq_id = len(accepted) + 1
        base = types.OptimStepRequest(adam_params=types.AdamParams(), model_id=model_id,
                                      seq_id=seq_id).model_dump(mode="json", exclude_none=True)
        doc = data.draw(mutated_json(base, (("seq_id",),)))
        if (rid := accepted_id(post_json(fuzz, "/optim_step", doc))) and doc.get("seq_id") == seq_id:
            accepted.append(rid)

    attack()
    drain(fuzz, accepted)
    sc.close("success").result(timeout=30)
    assert_server_healthy(fuzz)


# forward_backward: protobuf. Each mutation edits a valid ForwardBackwardRequest in place.


def fb_message(model_id: str, seq_id: int) -> pb.ForwardBackwardRequest:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[sft_datum([1, 2, 3, 4, 5])], loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id)
    return forward_backward_request_to_proto(req)


def _first_tensor(msg: pb.ForwardBackwardRequest, draw) -> pb.Tensor | None:
    if not msg.data or not msg.data[0].loss_fn_inputs:
        return None
    inputs = msg.data[0].loss_fn_inputs
    return inputs[draw(st.sampled_from(sorted(inputs)))]


def m_seq_id(msg, draw):
    # Behind, negative, or beyond the seq-ahead limit; never a small gap, which would only
    # make the run wait out the gap timeout.
    msg.seq_id = draw(st.sampled_from([0, -1, 1, 2**31 - 1, -(2**31), msg.seq_id + 10**6]))


def m_model_id(msg, draw):
    known = st.sampled_from(["", "x", "sess-x:train:0", msg.model_id + ":1", "\x00"])
    msg.model_id = draw(known | st.text(max_size=30))


def m_loss_fn(msg, draw):
    known = st.sampled_from(["", "nope", "importance_sampling", "ppo", "cispo", "dro"])
    msg.loss_fn = draw(known | st.text(max_size=20))


def m_loss_config(msg, draw):
    key = draw(st.sampled_from(["clip_low_threshold", "clip_high_threshold", "beta", "x"]) | st.text(max_size=8))
    value = draw(st.floats() | st.sampled_from([math.nan, math.inf, -math.inf, 1e308]))
    msg.loss_fn_config[key] = value
    if draw(st.booleans()):
        msg.loss_fn_config_v2[key].text = draw(st.text(max_size=10))


def m_forward_only(msg, draw):
    msg.forward_only = not msg.forward_only


def m_datum_count(msg, draw):
    datum = pb.Datum()
    if msg.data:
        datum.CopyFrom(msg.data[0])
    del msg.data[:]
    for _ in range(draw(st.sampled_from([0, 2, 64]))):
        msg.data.add().CopyFrom(datum)


def m_tokens(msg, draw):
    if msg.data and msg.data[0].model_input:
        raw = draw(st.binary(max_size=64) | st.sampled_from([b"\xff\xff\xff\x7f" * 4, b"\x00" * 4000, b"\x01\x02\x03"]))
        msg.data[0].model_input[0].encoded_text.tokens = raw


def m_chunk_kind(msg, draw):
    if msg.data:
        chunk = msg.data[0].model_input.add()
        kind = draw(st.sampled_from(["empty", "image", "dmel"]))
        if kind == "image":
            chunk.image.data = draw(st.binary(max_size=32))
            chunk.image.format = draw(st.sampled_from(["png", "jpeg", "gif", ""]))
            chunk.image.expected_tokens = draw(st.integers(-(2**31), 2**31 - 1))
        elif kind == "dmel":
            chunk.dmel.dmel = draw(st.binary(max_size=32))


def m_tensor_dtype(msg, draw):
    if (t := _first_tensor(msg, draw)) is not None:
        t.dtype = draw(st.integers(0, 8))


def m_tensor_shape(msg, draw):
    if (t := _first_tensor(msg, draw)) is not None:
        del t.shape[:]
        t.shape.extend(draw(st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(-2, 8), max_size=3)))


def m_tensor_dense(msg, draw):
    if (t := _first_tensor(msg, draw)) is not None:
        t.dense = draw(st.binary(max_size=64) | st.just(np.array([np.nan, np.inf, 1, 1], "<f4").tobytes()))


def m_tensor_sparse(msg, draw):
    if (t := _first_tensor(msg, draw)) is not None:
        ints = st.lists(st.integers(-(2**40), 2**40), max_size=6).map(lambda v: np.array(v, "<i8").tobytes())
        t.sparse_csr.values = draw(st.binary(max_size=32))
        t.sparse_csr.crow_indices = draw(ints)
        t.sparse_csr.col_indices = draw(ints)
        del t.shape[:]
        t.shape.extend(draw(st.lists(st.integers(-(2**62), 2**62) | st.integers(0, 5), min_size=2, max_size=2)))


def m_sparse_huge(msg, draw):
    """A well-formed empty CSR tensor whose dense shape is enormous (a few bytes on the wire)."""
    if (t := _first_tensor(msg, draw)) is not None:
        t.ClearField("dense")
        t.sparse_csr.crow_indices = np.zeros(2, "<i8").tobytes()
        del t.shape[:]
        t.shape.extend([1, draw(st.sampled_from([2**31, 2**40, 2**62]))])


def m_sparse_topk(msg, draw):
    """Top-K `target_tokens` as an empty CSR tensor: the issue's 114-byte [1, 67108864] and
    K just over the vocabulary (each row of a real request's N)."""
    if msg.data:
        t = msg.data[0].loss_fn_inputs["target_tokens"]
        rows = draw(st.sampled_from([1, 4]))
        t.Clear()
        t.dtype = pb.DTYPE_INT64
        t.sparse_csr.crow_indices = np.zeros(rows + 1, "<i8").tobytes()
        t.shape.extend([rows, draw(st.sampled_from([2**26, 85, 10**6]))])


def m_inputs(msg, draw):
    if msg.data:
        inputs = msg.data[0].loss_fn_inputs
        if inputs and draw(st.booleans()):
            del inputs[draw(st.sampled_from(sorted(inputs)))]
        else:
            inputs[draw(st.text(max_size=10))].CopyFrom(pb.Tensor(dtype=pb.DTYPE_FLOAT32, dense=b"\x00" * 16))


def m_spans(msg, draw):
    if msg.data:
        for field_name in draw(st.sampled_from([["model_input_spans"], ["model_input_spans", "loss_fn_input_spans"]])):
            span = getattr(msg.data[0], field_name).add()
            arm = span.prompt_tokens if draw(st.booleans()) else span.sampled_tokens
            arm.sequence_id = draw(st.text(max_size=10))
            arm.offset = draw(st.integers(-(2**63), 2**63 - 1))
            arm.length = draw(st.integers(-(2**63), 2**63 - 1))


PROTO_MUTATIONS = [m_seq_id, m_model_id, m_loss_fn, m_loss_config, m_forward_only, m_datum_count, m_tokens,
                   m_chunk_kind, m_tensor_dtype, m_tensor_shape, m_tensor_dense, m_tensor_sparse, m_sparse_huge,
                   m_sparse_topk, m_inputs, m_spans]


@st.composite
def mutated_fb_bytes(draw, base: pb.ForwardBackwardRequest) -> tuple[bytes, dict[str, str]]:
    """A mutated message, then maybe broken at the byte level, with its headers."""
    msg = pb.ForwardBackwardRequest()
    msg.CopyFrom(base)
    for mutate in draw(st.lists(st.sampled_from(PROTO_MUTATIONS), min_size=0, max_size=3)):
        mutate(msg, draw)
    raw = msg.SerializeToString()
    damage = draw(st.sampled_from(["none", "none", "truncate", "flip", "random", "zstd", "bad_encoding"]))
    headers = {**AUTH, "Content-Type": PROTO}
    if damage == "truncate":
        raw = raw[: draw(st.integers(0, max(len(raw) - 1, 0)))]
    elif damage == "flip" and raw:
        i = draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + bytes([raw[i] ^ draw(st.integers(1, 255))]) + raw[i + 1:]
    elif damage == "random":
        raw = draw(st.binary(max_size=256))
    elif damage == "zstd":
        raw, headers["Content-Encoding"] = zstandard.ZstdCompressor().compress(raw), "zstd"
    elif damage == "bad_encoding":
        headers["Content-Encoding"] = draw(st.sampled_from(["gzip", "zstd", "br, zstd"]))
    return raw, headers


def sent_seq_id(raw: bytes, headers: dict[str, str]) -> int | None:
    """The seq_id the server read from a body the mutations may have damaged."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(zstandard.decompress(raw) if headers.get("Content-Encoding") == "zstd" else raw)
    except Exception:  # noqa: BLE001 - undecodable: the server refused it too
        return None
    return msg.seq_id


def test_mutated_forward_backward(fuzz, targets):
    accepted: list[str] = []
    next_seq = [1]  # the run's next expected seq_id: each base body is the next one in order

    @FUZZ_SETTINGS
    @given(data=st.data())
    def attack(data):
        raw, headers = data.draw(mutated_fb_bytes(fb_message(targets.model_id, next_seq[0])))
        r = fuzz.http.post(fuzz.server.base_url + "/api/v1/forward_backward", content=raw, headers=headers, timeout=60)
        fuzz.saw("POST", "/forward_backward", r, raw[:200])
        if rid := accepted_id(r):
            accepted.append(rid)
            if sent_seq_id(raw, headers) == next_seq[0]:  # anything else was a replay or refused
                next_seq[0] += 1

    attack()
    drain(fuzz, accepted)
    assert_server_healthy(fuzz)


def _seeded_bodies(path: str) -> list[bytes]:
    """The issue's hostile JSON, in every body: a lone surrogate in a value and in a key,
    2 kB of nesting 1,000 deep, and nesting under a field."""
    bodies = [json.dumps({"request_id": s, "model_id": s, "session_id": s}).encode() for s in SURROGATES]
    bodies += [b'{"x\\ud800":1}', b"[" * 1000 + b"]" * 1000, b'{"a":' + b"[" * 3000 + b"]" * 3000 + b"}"]
    return bodies + [json.dumps({"user_metadata": d, "events": d, "prompt": d}).encode() for d in DEEP]


@pytest.mark.parametrize("path", sorted(BODY_MODELS))
def test_seeded_surrogates_and_nesting(fuzz, path):
    """Every JSON route answers the seeded cases with a 4xx (no 5xx, no traceback)."""
    for body in _seeded_bodies(path):
        r = fuzz.http.post(fuzz.server.base_url + path, content=body, timeout=60,
                       headers={**AUTH, "Content-Type": "application/json"})
        fuzz.saw("POST", path, r, body[:100])
        assert 400 <= r.status_code < 500, (path, body[:80], r.status_code, r.text[:300])
    problems = server_problems(fuzz)
    assert not problems, "\n".join(problems)


def test_seeded_sparse_shapes(fuzz):
    """The 114-byte forward (sparse [1, 67108864]) and K over the vocabulary: refused as
    the user's error, never a MemoryError in the capped server."""
    sc = tinker.ServiceClient(base_url=fuzz.server.base_url, api_key=API_KEY)
    model_id = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result(timeout=60).get_info().model_id
    accepted: list[str] = []
    for shape in [[1, 2**26], [4, 85], [1, 2**40], [4, 10**6], [4, 2**20]]:
        msg = fb_message(model_id, len(accepted) + 1)  # in order: refused ones never reached the run
        t = msg.data[0].loss_fn_inputs["target_tokens"]
        t.Clear()
        t.dtype, t.sparse_csr.crow_indices = pb.DTYPE_INT64, np.zeros(shape[0] + 1, "<i8").tobytes()
        t.shape.extend(shape)
        r = fuzz.http.post(fuzz.server.base_url + "/api/v1/forward_backward", content=msg.SerializeToString(),
                       headers={**AUTH, "Content-Type": PROTO}, timeout=60)
        fuzz.saw("POST", "/forward_backward", r, shape)
        if rid := accepted_id(r):
            accepted.append(rid)
    drain(fuzz, accepted)
    sc.close("success").result(timeout=30)
    assert_server_healthy(fuzz)


# ---------------------------------------------------------------------------------------
# A client that hangs up while the server holds its long-poll
# ---------------------------------------------------------------------------------------


def _raw_retrieve(port: int, request_id: str, *, missing_body_bytes: int = 0) -> None:
    """POST retrieve_future over a bare socket and close it without reading the answer;
    `missing_body_bytes` > 0 promises more body than is sent (a hang-up mid-upload)."""
    body = json.dumps({"request_id": request_id}).encode()
    head = (f"POST /api/v1/retrieve_future HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body) + missing_body_bytes}\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head.encode() + body)
        time.sleep(0.5)  # the server is now holding the poll (or waiting for the rest of the body)


def test_client_hanging_up_mid_long_poll_is_one_log_line(fuzz, targets):
    server = fuzz.server
    # A pending future: seq_id 3 of a fresh run waits SEQ_GAP_S for the missing 1 and 2.
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    model_id = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result(timeout=60).get_info().model_id
    r = httpx.post(server.base_url + "/api/v1/forward_backward", headers={**AUTH, "Content-Type": PROTO},
                   content=fb_message(model_id, 3).SerializeToString(), timeout=60)
    request_id = r.json()["request_id"]
    stderr_before, mark = len(server.stderr_path.read_text()), server.log_mark()

    hang_ups = [threading.Thread(target=_raw_retrieve, args=(server.port, request_id), kwargs={"missing_body_bytes": n})
                for n in (0, 50)]  # together: both within the SEQ_GAP_S the future stays pending
    for t in hang_ups:
        t.start()
    for t in hang_ups:
        t.join()

    # Both polls end at once (not after the long-poll or the future): 499 in the request log.
    polls = wait_until(lambda: len(e := server.requests_since(mark, "/retrieve_future")) == 2 and e, timeout=3,
                       message="both hung-up polls to be released")
    assert all(e.get("status") == 499 and e["t_end"] - e["t"] < LONG_POLL_S / 2 for e in polls), polls
    new = server.stderr_path.read_text()[stderr_before:]
    assert "Traceback" not in new and "Exception in ASGI" not in new, new
    lines = [line for line in new.splitlines() if "closed the connection" in line]
    assert len(lines) == 2 and any(request_id in line for line in lines), new  # one line per hung-up client

    # The future itself was not touched: it still finishes and answers the next poll.
    def finished():
        resp = httpx.post(server.base_url + "/api/v1/retrieve_future", json={"request_id": request_id},
                          headers={**AUTH, "Accept": "application/json"}, timeout=LONG_POLL_S + 30).json()
        return resp if resp.get("type") != "try_again" else None

    assert "loss:sum" in wait_until(finished, timeout=60, message="the future")["metrics"]
    sc.close("success").result(timeout=30)
    assert_server_healthy(fuzz)


# ---------------------------------------------------------------------------------------
# The check can fail
# ---------------------------------------------------------------------------------------


def test_the_check_catches_a_faulty_route(tiny_model_dir, tmp_path_factory):
    script = Path(__file__).with_name("fault_server.py")
    server = start_fuzz_server(tiny_model_dir, tmp_path_factory.mktemp("fuzz-fault"), script=script)
    try:
        httpx.post(server.base_url + "/_test/faults", timeout=10,
                   json={"rules": [{"path": "/create_session", "raise": "boom"}]}).raise_for_status()
        faulty = Fuzzed(server)
        run_schemathesis(faulty, "/api/v1/create_session", "POST", max_examples=3)
        with pytest.raises(AssertionError) as failed:
            assert_server_healthy(faulty)
        report = str(failed.value)
        assert "POST /api/v1/create_session -> 500" in report  # seen by the client
        assert "request log: POST /api/v1/create_session -> no answer" in report  # and by the server
        assert "traceback in the server's stderr" in report and "injected fault: boom" in report
    finally:
        server.stop()
