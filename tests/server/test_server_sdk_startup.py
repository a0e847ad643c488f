"""docs/protocol.md §9 items 1-3, 7-9, 11 and API-key handling: the unmodified official
SDK against `ember serve` (a real subprocess), checked on the server's request log."""

from __future__ import annotations

import time

import pytest
import tinker

from helpers.server import API_KEY, MODEL_NAME, OTHER_KEY, paths, wait_until

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def background_clients(ember_server):
    """Two sessions created first, inspected last (heartbeats need > 20 s of wall time):
    one with telemetry on, one with TINKER_TELEMETRY=0."""
    clients = {}
    with pytest.MonkeyPatch.context() as mp:
        for name, flag in (("telemetry_on", "1"), ("telemetry_off", "0")):
            mp.setenv("TINKER_TELEMETRY", flag)
            sc = tinker.ServiceClient(base_url=ember_server.base_url, api_key=API_KEY)
            tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
            clients[name] = (sc, tc.get_info().model_id.split(":train:")[0], time.monotonic())
    yield clients
    for sc, _, _ in clients.values():
        sc.close("success").result(timeout=30)


# Sent on their own schedule by the background clients' sessions (and the SDK's telemetry):
# they may land in any window, so the sequence checks below leave them out.
BACKGROUND = ("/session_heartbeat", "/telemetry")


def _foreground(entries: list[dict]) -> list[dict]:
    return [e for e in entries if not e["path"].endswith(BACKGROUND)]


def test_client_is_lazy_then_makes_the_documented_sequence(ember_server, background_clients):
    mark = ember_server.log_mark()
    sc = tinker.ServiceClient(base_url=ember_server.base_url, api_key=API_KEY)
    time.sleep(0.5)
    assert _foreground(ember_server.requests_since(mark)) == [], "constructing a ServiceClient must not send anything"
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
    seen = paths(_foreground(ember_server.requests_since(mark)))
    polls = seen.count("/retrieve_future")
    assert polls >= 1
    assert seen == ["/client/config", "/client/dynamic_config", "/create_session", "/create_model",
                    *["/retrieve_future"] * polls, "/get_info"]
    session_id = ember_server.requests_since(mark, "/create_session")[0]["response"]["session_id"]
    assert tc.get_info().model_id == f"{session_id}:train:0"
    assert all(e["status"] == 200 for e in _foreground(ember_server.requests_since(mark)))
    sc.close("success").result(timeout=30)


def test_env_vars_with_trailing_slash(ember_server, background_clients, monkeypatch):
    monkeypatch.setenv("TINKER_BASE_URL", ember_server.base_url + "/")
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    mark = ember_server.log_mark()
    sc = tinker.ServiceClient()
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
    assert tc.get_info().model_data.model_name == MODEL_NAME
    assert paths(ember_server.requests_since(mark))[:3] == ["/client/config", "/client/dynamic_config",
                                                            "/create_session"]
    assert all("//" not in e["path"] for e in ember_server.requests_since(mark))
    sc.close("success").result(timeout=30)


def test_bad_key_formats_fail_locally(ember_server, background_clients, monkeypatch, tmp_path):
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    monkeypatch.delenv("TINKER_CREDENTIAL_CMD", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.tinker/credentials.json
    mark = ember_server.log_mark()
    with pytest.raises(tinker.TinkerError, match="tml-"):
        sc = tinker.ServiceClient(base_url=ember_server.base_url, api_key="sk-x")
        sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
    with pytest.raises(tinker.TinkerError, match="api_key client option must be set"):
        sc = tinker.ServiceClient(base_url=ember_server.base_url, api_key="")
        sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
    assert ember_server.requests_since(mark) == []


def test_unknown_key_gets_401_with_json_body(ember_server, background_clients):
    mark = ember_server.log_mark()
    sc = tinker.ServiceClient(base_url=ember_server.base_url, api_key="tml-not-a-known-key")
    with pytest.raises(tinker.AuthenticationError):
        sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
    entries = ember_server.requests_since(mark)
    assert entries and entries[0]["path"] == "/api/v1/client/config"
    assert {e["status"] for e in entries} == {401}
    assert entries[0]["response"] == {"error": "invalid API key", "category": "user"}


def test_rest_client_makes_no_session(ember_server, background_clients):
    # The SDK shares one sessionless holder per (base_url, key) in a process; a base URL no
    # other test uses makes this RestClient fetch its config afresh.
    base_url = ember_server.base_url.replace("127.0.0.1", "localhost")
    mark = ember_server.log_mark()
    rc = tinker.RestClient(base_url=base_url, api_key=OTHER_KEY)
    runs = rc.list_training_runs().result()
    assert isinstance(runs, tinker.types.TrainingRunsResponse)
    seen = paths(ember_server.requests_since(mark))
    assert seen == ["/client/config", "/client/dynamic_config", "/training_runs"]
    caps = rc.get_server_capabilities().result()
    assert MODEL_NAME in [m.model_name for m in caps.supported_models]


def test_with_block_sends_finish_success_and_errored(ember_server, background_clients):
    mark = ember_server.log_mark()
    with tinker.ServiceClient(base_url=ember_server.base_url, api_key=API_KEY) as sc:
        sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
    with pytest.raises(RuntimeError, match="boom"):
        with tinker.ServiceClient(base_url=ember_server.base_url, api_key=API_KEY) as sc:
            sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
            raise RuntimeError("boom")

    def finishes_so_far():
        found = [e for e in ember_server.requests_since(mark) if e["path"].endswith("/finish")]
        return found if len(found) >= 2 else None

    finishes = wait_until(finishes_so_far, timeout=30, message="two finish requests")
    assert [f["json"]["reason"]["type"] for f in finishes] == ["success", "errored"]
    assert all(f["status"] == 200 for f in finishes)
    sessions = [e["response"]["session_id"] for e in ember_server.requests_since(mark, "/create_session")]
    assert [f["path"] for f in finishes] == [f"/api/v1/sessions/{s}/finish" for s in sessions]


def test_heartbeats_and_telemetry(ember_server, background_clients):
    """Last in the module: by now the background sessions are ~20 s old."""
    _, session_on, created = background_clients["telemetry_on"]
    _, session_off, _ = background_clients["telemetry_off"]

    def heartbeats(session_id):
        return [e for e in ember_server.requests("/session_heartbeat") if e["json"].get("session_id") == session_id]

    beats = wait_until(lambda: heartbeats(session_on) if len(heartbeats(session_on)) >= 2 else None,
                       timeout=max(1.0, 35 - (time.monotonic() - created)), message="two heartbeats")
    assert beats[1]["t"] - beats[0]["t"] == pytest.approx(10.0, abs=3.0)
    assert all(b["status"] == 200 and b["response"] == {"type": "session_heartbeat"} for b in beats)
    telemetry = [e for e in ember_server.requests("/telemetry") if e["json"].get("session_id") == session_on]
    assert telemetry, "telemetry is on by default and flushes every 10 s"
    assert any("SESSION_START" in (t["extra"] or {}).get("events", []) for t in telemetry)
    assert all(t["response"] == {"status": "accepted"} for t in telemetry)
    assert [e for e in ember_server.requests("/telemetry") if e["json"].get("session_id") == session_off] == []
    assert len(heartbeats(session_off)) >= 1
