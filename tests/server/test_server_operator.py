"""What an operator sees: one log line per run created, checkpoint saved, sampler loaded and
request failed as `server`; a compact request log bounded by rotation; and the SDK's own
`tinker run list` / `tinker checkpoint list` against `ember serve`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import tinker
from fastapi import FastAPI
from fastapi.testclient import TestClient

from ember.server.middleware import RequestLogMiddleware
from helpers.server import API_KEY, MODEL_NAME, sft_datum, start_server
from helpers.zygote import run_module


def logged_app(path: Path, **kwargs) -> TestClient:
    app = FastAPI()

    @app.post("/api/v1/forward_backward")
    def fb(body: dict) -> dict:
        return {"request_id": "r" * 40, "echo": body}

    app.add_middleware(RequestLogMiddleware, path=str(path), **kwargs)
    return TestClient(app)


def test_request_log_lines_are_short_without_bodies(tmp_path):
    log = tmp_path / "requests.jsonl"
    big = {"data": [list(range(2000))]}  # a forward_backward body of ~10 KB
    with logged_app(log) as http:
        for _ in range(3):
            assert http.post("/api/v1/forward_backward", json=big).status_code == 200
    lines = log.read_text().splitlines()
    assert len(lines) == 3 and all(len(line) < 200 for line in lines), lines
    entry = json.loads(lines[0])
    assert entry.keys() == {"n", "t", "ms", "method", "path", "status", "extra"}
    assert entry["path"] == "/api/v1/forward_backward" and entry["status"] == 200


def test_request_log_bodies_on_keeps_them(tmp_path):
    log = tmp_path / "requests.jsonl"
    with logged_app(log, bodies=True) as http:
        http.post("/api/v1/forward_backward", json={"a": 1})
    entry = json.loads(log.read_text())
    assert entry["json"] == {"a": 1} and entry["response"]["echo"] == {"a": 1} and "headers" in entry


def test_a_request_is_in_the_log_before_its_answer_leaves(tmp_path):
    """A client may act on an answer at once (and a test read the log): the entry is
    written before the last body message is sent, not after."""
    import asyncio

    log = tmp_path / "requests.jsonl"

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"a": ', "more_body": True})
        await send({"type": "http.response.body", "body": b"1}"})

    logged_when_sent = []

    async def send(message):
        if message["type"] == "http.response.body":
            logged_when_sent.append(len(log.read_text().splitlines()))

    async def receive():
        return {"type": "http.request", "body": b"{}"}

    scope = {"type": "http", "method": "POST", "path": "/api/v1/forward_backward", "headers": []}
    asyncio.run(RequestLogMiddleware(app, path=str(log), bodies=True)(scope, receive, send))
    assert logged_when_sent == [0, 1]  # not before the answer is complete; before its last bytes go
    assert json.loads(log.read_text())["response"] == {"a": 1}


def test_request_log_rotates_by_size(tmp_path):
    log = tmp_path / "requests.jsonl"
    with logged_app(log, max_bytes=1000) as http:
        for _ in range(40):  # ~150 bytes each: ~6000 bytes in all
            http.post("/api/v1/forward_backward", json={})
    rotated = Path(str(log) + ".1")
    assert rotated.is_file() and log.stat().st_size <= 1000 and rotated.stat().st_size <= 1000
    numbers = [json.loads(line)["n"] for line in log.read_text().splitlines()]
    assert numbers[-1] == 39  # the newest line is in the current file


@pytest.mark.slow
def test_operator_log_lines_and_the_sdk_cli(tiny_model_dir, tmp_path):
    # the first save fails with a full disk: a `server` failure the operator must see
    server = start_server(Path(tiny_model_dir), tmp_path / "serve", extra_args=["--log-level", "info"],
                          env={"EMBER_FAILPOINTS": "checkpoint.before_write=enospc*1"})
    try:
        sc = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
        tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
        tc.forward_backward([sft_datum([1, 2, 3, 4])], "cross_entropy").result()
        with pytest.raises(Exception, match="No space left on device"):
            tc.save_state("full-disk").result()
        path = tc.save_state("c1").result().path
        sc.create_sampling_client(base_model=MODEL_NAME)
        cli = {"runs": run_cli(server.base_url, "run", "list"),
               "checkpoints": run_cli(server.base_url, "checkpoint", "list", "--run-id", tc.model_id)}
        sc.close("success")
    finally:
        server.stop()
    err = server.stderr_path.read_text()
    lines = {what: [line for line in err.splitlines() if needle in line] for what, needle in [
        ("run", f"run {tc.model_id} created"), ("checkpoint", f"checkpoint {path} saved"),
        ("sampler", "sampler loaded for base model"), ("failed", "failed (server): storage error")]}
    assert all(len(found) == 1 for found in lines.values()), (lines, err[-3000:])
    assert tc.model_id in cli["runs"], cli
    assert path in cli["checkpoints"], cli


def run_cli(base_url: str, *args: str) -> str:
    """The SDK's own CLI (`tinker ...`), configured only by the environment, as a user runs it."""
    env = dict(os.environ, TINKER_BASE_URL=base_url, TINKER_API_KEY=API_KEY)
    proc = run_module("tinker.cli", ["--format", "json", *args], env=env, timeout=120)  # forked: helpers.zygote
    assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-2000:])
    return proc.stdout
