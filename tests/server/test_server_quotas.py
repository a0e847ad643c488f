"""Quotas per API key, idle session expiry and out-of-memory messages, against `ember serve`
(issue 24, item 5): one tenant filling its quota of runs, sessions, sampling sessions or
checkpoint bytes is refused as a user error naming the quota, its value and how to free
it, while another tenant keeps working; an idle session is ended and its run unloaded
(heartbeats alone do not keep it); an out-of-memory failure says so without a server path.

Each test uses API keys of its own (the servers accept several), so the tests do not
depend on each other's order. The servers run under an address-space cap.
"""

from __future__ import annotations

import re

import httpx
import pytest
import tinker

from helpers.server import API_KEY, MODEL_NAME, future_outcome, memory_cap, start_server, wait_until

pytestmark = pytest.mark.slow

KEYS = ["tml-runs", "tml-sessions", "tml-samplers", "tml-bytes", "tml-idle", "tml-busy"]
QUOTAS = {"max_runs_per_key": 2, "max_sessions_per_key": 3, "max_sampling_sessions_per_key": 2,
          "max_checkpoint_bytes_per_key": 200_000}  # ~2 training saves of the tiny model (82 KB each)
PATH_IN_TEXT = re.compile(r"/[\w.\-]+/[\w.\-]+")


def _serve(tiny_model_dir, workdir, args=(), env=None):
    keys = [a for k in KEYS for a in ("--api-key", k)]
    return start_server(tiny_model_dir, workdir, extra_args=[*keys, *args], wrap=memory_cap(8 << 30), env=env)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = _serve(tiny_model_dir, tmp_path_factory.mktemp("quotas"),
                 [a for k, v in QUOTAS.items() for a in (f"--limits.{k}", str(v))])
    yield srv
    srv.stop()


def client(server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.base_url + "/api/v1", headers={"X-API-Key": key}, timeout=120)


def new_session(http: httpx.Client) -> httpx.Response:
    return http.post("/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"})


def outcome(http: httpx.Client, response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return future_outcome(http, response.json()["request_id"])


def create_run(http: httpx.Client, session_id: str, seq: int) -> dict:
    return outcome(http, http.post("/create_model", json={
        "session_id": session_id, "model_seq_id": seq, "base_model": MODEL_NAME, "lora_config": {"rank": 2}}))


def user_error(out: dict, *words: str) -> None:
    assert out.get("category") == "user", out
    for w in words:
        assert w in out["error"], out["error"]


def test_runs_quota_refuses_the_next_run_of_that_key_only(server):
    with client(server, "tml-runs") as b:
        sid = new_session(b).json()["session_id"]
        for seq in range(QUOTAS["max_runs_per_key"]):
            assert "model_id" in create_run(b, sid, seq)
        out = create_run(b, sid, 9)
        user_error(out, "training runs quota", "limits.max_runs_per_key=2", "close its ServiceClient")
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)  # tenant A, the official SDK
    try:
        tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result(timeout=120)
        assert tc.get_info().model_id
    finally:
        sc.close("success").result(timeout=30)


def test_sessions_quota_is_a_400_naming_it_and_a_finished_session_frees_one(server):
    with client(server, "tml-sessions") as b, client(server, API_KEY) as a:
        ids = [new_session(b).json()["session_id"] for _ in range(QUOTAS["max_sessions_per_key"])]
        r = new_session(b)
        assert r.status_code == 400, r.text
        assert r.json()["category"] == "user"
        assert "sessions quota" in r.json()["error"] and "limits.max_sessions_per_key=3" in r.json()["error"]
        assert new_session(a).status_code == 200  # another key is not affected
        assert b.post(f"/sessions/{ids[0]}/finish", json={"reason": {"type": "success"}}).status_code == 200
        assert new_session(b).status_code == 200


def test_sampling_sessions_quota(server):
    with client(server, "tml-samplers") as b, client(server, API_KEY) as a:
        sid = new_session(b).json()["session_id"]

        def sampler(http, session_id, seq):
            return http.post("/create_sampling_session", json={
                "session_id": session_id, "sampling_session_seq_id": seq, "base_model": MODEL_NAME})

        for seq in range(QUOTAS["max_sampling_sessions_per_key"]):
            assert sampler(b, sid, seq).status_code == 200
        assert sampler(b, sid, 0).status_code == 200  # a retry of one already made is not a new one
        r = sampler(b, sid, 5)
        assert r.status_code == 400 and r.json()["category"] == "user", r.text
        assert "limits.max_sampling_sessions_per_key=2" in r.json()["error"]
        a_sid = new_session(a).json()["session_id"]
        assert sampler(a, a_sid, 0).status_code == 200


def save(http: httpx.Client, model_id: str, seq: int, name: str) -> dict:
    return outcome(http, http.post("/save_weights", json={"model_id": model_id, "seq_id": seq, "path": name}))


def test_checkpoint_bytes_quota_refuses_the_save_removes_its_files_and_delete_frees_space(server):
    quota = QUOTAS["max_checkpoint_bytes_per_key"]
    with client(server, "tml-bytes") as b:
        sid = new_session(b).json()["session_id"]
        model_id = create_run(b, sid, 0)["model_id"]
        saved, refusal = [], None
        for seq in range(1, 20):
            out = save(b, model_id, seq, f"ck{seq}")
            if "error" in out:
                refusal = out
                break
            saved.append(out["path"])
        assert saved and refusal is not None, (saved, refusal)
        user_error(refusal, "checkpoint bytes quota", f"limits.max_checkpoint_bytes_per_key={quota}",
                   "delet")
        listed = b.get("/checkpoints").json()["checkpoints"]
        assert {c["tinker_path"] for c in listed} == set(saved)
        assert sum(c["size_bytes"] for c in listed) <= quota
        on_disk = list((server.data_dir / "checkpoints").glob(f"*/weights/ck{len(saved) + 1}*"))
        assert on_disk == []  # the refused save's files are gone
        run_id, ck = saved[0][len("tinker://"):].split("/", 1)
        assert b.delete(f"/training_runs/{run_id}/checkpoints/{ck}").status_code == 200
        assert "path" in save(b, model_id, len(saved) + 2, "after-delete")


@pytest.fixture(scope="module")
def idle_server(tiny_model_dir, tmp_path_factory):
    srv = _serve(tiny_model_dir, tmp_path_factory.mktemp("idle"),
                 ["--sessions.idle_ttl_s", "3", "--limits.max_runs_per_key", "1"])
    yield srv
    srv.stop()


def test_an_idle_session_expires_despite_heartbeats_and_its_run_is_unloaded(idle_server):
    with client(idle_server, "tml-idle") as idle, client(idle_server, "tml-busy") as busy:
        sid = new_session(idle).json()["session_id"]
        model_id = create_run(idle, sid, 0)["model_id"]
        busy_sid = new_session(busy).json()["session_id"]
        busy_model = create_run(busy, busy_sid, 0)["model_id"]
        step = iter(range(1, 10_000))

        def still_idle() -> bool:  # heartbeats for the idle one, real requests for the busy one
            out = outcome(busy, busy.post("/optim_step", json={
                "model_id": busy_model, "seq_id": next(step), "adam_params": {"learning_rate": 1e-9}}))
            assert "error" not in out, out
            return idle.post("/session_heartbeat", json={"session_id": sid}).status_code == 200

        wait_until(lambda: not still_idle(), timeout=30, interval=0.5, message="the idle session expired")
        r = idle.post("/session_heartbeat", json={"session_id": sid})
        assert r.status_code == 410 and "idle" in r.json()["error"] and "sessions.idle_ttl_s" in r.json()["error"]
        out = save(idle, model_id, 1, "late")
        assert "not loaded" in out["error"], out  # the run was unloaded with its session
        assert busy.post("/session_heartbeat", json={"session_id": busy_sid}).status_code == 200
        # its run no longer counts against max_runs_per_key=1: a new session of the key gets one
        assert "model_id" in create_run(idle, new_session(idle).json()["session_id"], 0)


@pytest.fixture(scope="module")
def oom_server(tiny_model_dir, tmp_path_factory):
    srv = _serve(tiny_model_dir, tmp_path_factory.mktemp("oom"), env={"EMBER_FAILPOINTS": "run.create_engine=mmap*1"})
    yield srv
    srv.stop()


def test_an_out_of_memory_failure_names_no_server_path(oom_server):
    """torch's words when loading safetensors runs out of memory name the file it mapped;
    the client is told it ran out of memory, and the server keeps serving."""
    with client(oom_server, API_KEY) as a:
        sid = new_session(a).json()["session_id"]
        out = create_run(a, sid, 0)
        assert out.get("category") == "server", out
        assert "out of memory" in out["error"] and "model.safetensors" not in out["error"], out
        assert not PATH_IN_TEXT.search(out["error"]), out["error"]
        assert "model_id" in create_run(a, sid, 1)
