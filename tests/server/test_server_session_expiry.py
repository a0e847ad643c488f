"""A client that dies without finishing its session (no heartbeat for
`--sessions.heartbeat_timeout_s`): the session ends, its run is saved and unloaded, the
key's runs quota is free again, the log says so, and the official SDK resumes the run from
the saved checkpoint. (The same with a manual clock, no waiting:
tests/service/test_service_core.py.)"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import tinker

from helpers.server import API_KEY, MODEL_NAME, sft_datum, start_server, wait_until

pytestmark = pytest.mark.slow

# Above the SDK's 10 s heartbeat period (the live client below must not expire), and short
# enough to wait for.
HEARTBEAT_TIMEOUT_S = 15


def test_a_dead_clients_session_ends_and_its_run_is_saved_and_resumable(tiny_model_dir, tmp_path):
    server = start_server(Path(tiny_model_dir), tmp_path, extra_args=[
        "--log-level", "info", "--limits.max_runs_per_key", "1",
        "--sessions.heartbeat_timeout_s", str(HEARTBEAT_TIMEOUT_S)])
    try:
        # the "killed script": a session and a run over raw HTTP, and then no heartbeat ever
        http = httpx.Client(base_url=server.base_url + "/api/v1", headers={"X-API-Key": API_KEY}, timeout=120)
        body = {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}
        sid = http.post("/create_session", json=body).json()["session_id"]
        created = http.post("/create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": MODEL_NAME,
                                                   "lora_config": {"rank": 2}}).json()
        run_id = created["model_id"]
        wait_until(lambda: http.post("/retrieve_future", json={"request_id": created["request_id"]}).json()
                   .get("type") != "try_again", timeout=120, message="the run")
        saved = f"tinker://{run_id}/weights/session-end"
        log = wait_until(lambda: (t := server.stderr_path.read_text()) and f"saved as {saved}" in t and t,
                         timeout=HEARTBEAT_TIMEOUT_S + 60, message="the session's end")
        assert f"session {sid} expired (no heartbeat for more than {HEARTBEAT_TIMEOUT_S} s)" in log
        assert http.post("/session_heartbeat", json={"session_id": sid}).status_code == 410

        sc = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
        # the quota (one run) is free again, and the run resumes from what was saved
        tc = sc.create_training_client_from_state_with_optimizer(saved).result(timeout=120)
        out = tc.forward_backward([sft_datum([1, 2, 3, 4])], "cross_entropy").result(timeout=120)
        assert out.loss_fn_outputs
        sc.close("success").result(timeout=30)
    finally:
        server.stop()
