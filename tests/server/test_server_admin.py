"""The operator's view: `ember serve --admin-api-key`, the admin routes, `ember admin`, and
the per-key usage counters of /metrics, against a real server driven by the official SDK."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from ember.cli import main as ember_main
from ember.server.config import short_key_id
from helpers.server import API_KEY, MODEL_NAME, OTHER_KEY, sft_datum, start_server

pytestmark = pytest.mark.slow  # a server of its own and SDK training

ADMIN_KEY = "tml-operator-secret-0123"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = start_server(Path(tiny_model_dir), tmp_path_factory.mktemp("ember-admin"),
                       extra_args=["--admin-api-key", ADMIN_KEY, "--log-level", "info"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def trained(server):
    """Key tml-test trains 2 steps and samples; key tml-other holds a session with a run."""
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=1).result()
    fb_tokens = 0
    for _ in range(2):
        out = tc.forward_backward([sft_datum([5, 17, 30, 42, 8])], "cross_entropy").result()
        fb_tokens += sum(len(o["logprobs"].data) for o in out.loss_fn_outputs)
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    tc.save_state("two").result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    resp = sampler.sample(types.ModelInput.from_ints([5, 17, 30]), num_samples=2,
                          sampling_params=types.SamplingParams(max_tokens=5, seed=3)).result()
    other = tinker.ServiceClient(base_url=server.base_url, api_key=OTHER_KEY)
    other_tc = other.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=2).result()
    yield {"sc": sc, "tc": tc, "fb_tokens": fb_tokens, "sampled": sum(len(s.tokens) for s in resp.sequences),
           "other": other, "other_tc": other_tc}
    sc.close("success").result(timeout=30)


def session_of(tc) -> str:
    return tc.model_id.split(":train:")[0]  # a run's id is "<session id>:train:<n>"


def admin(server, method: str, path: str, key: str | None = ADMIN_KEY) -> httpx.Response:
    headers = {"X-API-Key": key} if key else {}
    return httpx.request(method, f"{server.base_url}/api/v1/admin{path}", headers=headers, timeout=60)


def cli(server, capsys, *args: str) -> tuple[int, str, str]:
    rc = ember_main(["admin", "--url", server.base_url, "--admin-api-key", ADMIN_KEY, *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_other_keys_are_refused_with_the_reason(server, trained):
    for method, path in (("GET", "/overview"), ("POST", "/sessions/x/end"), ("POST", "/training_runs/x/unload")):
        resp = admin(server, method, path, API_KEY)
        assert resp.status_code == 403, resp.text
        assert "not the server's --admin-api-key" in resp.json()["error"]
        assert admin(server, method, path, None).status_code == 401
        assert admin(server, method, path, "tml-unknown-key").status_code == 401
    # the ordinary owner checks still hold for the operator's key: another key's run is unknown to it
    resp = httpx.get(f"{server.base_url}/api/v1/training_runs/{trained['tc'].model_id}",
                     headers={"X-API-Key": ADMIN_KEY}, timeout=30)
    assert resp.status_code == 404


def test_cli_lists_every_keys_sessions_runs_checkpoints_and_usage(server, trained, capsys):
    rc, out, _ = cli(server, capsys, "runs")
    assert rc == 0
    assert trained["tc"].model_id in out and trained["other_tc"].model_id in out
    rc, out, _ = cli(server, capsys, "sessions")
    assert rc == 0 and session_of(trained["tc"]) in out and session_of(trained["other_tc"]) in out
    rc, out, _ = cli(server, capsys, "checkpoints")
    assert rc == 0 and f"tinker://{trained['tc'].model_id}/weights/two" in out
    rc, out, _ = cli(server, capsys, "usage")
    assert rc == 0
    row = next(line.split() for line in out.splitlines() if line.startswith(short_key_id(API_KEY)))
    header = out.splitlines()[0]
    assert "TRAINED TOKENS" in header and API_KEY not in out
    assert str(trained["fb_tokens"]) in row and str(trained["sampled"]) in row
    assert ember_main(["admin", "--url", server.base_url, "--admin-api-key", API_KEY, "usage"]) == 1
    assert "403" in capsys.readouterr().err


def test_metrics_count_per_key_and_never_name_the_key(server, trained):
    text = httpx.get(f"{server.base_url}/metrics", headers={"X-API-Key": API_KEY}, timeout=30).text
    samples = {(s.name, s.labels.get("key")): s.value for f in text_string_to_metric_families(text)
               for s in f.samples if s.name.startswith("ember_key_")}
    kid, other = short_key_id(API_KEY), short_key_id(OTHER_KEY)
    assert samples[("ember_key_trained_tokens_total", kid)] == trained["fb_tokens"]
    assert samples[("ember_key_sampled_tokens_total", kid)] == trained["sampled"]
    assert samples[("ember_key_runs_created_total", kid)] == 1
    assert samples[("ember_key_runs_created_total", other)] == 1
    assert samples[("ember_key_checkpoint_bytes", kid)] > 0
    assert samples.get(("ember_key_trained_tokens_total", other), 0) == 0
    for key in (API_KEY, OTHER_KEY, ADMIN_KEY):
        assert key not in text
    assert ADMIN_KEY not in server.stderr_path.read_text() + "".join(server.stdout_lines)


def test_operator_ends_a_session_and_unloads_a_run(server, trained, capsys):
    other_run = trained["other_tc"].model_id
    rc, out, _ = cli(server, capsys, "unload-run", other_run)
    assert rc == 0 and f"tinker://{other_run}/weights/session-end" in out
    rc, _, err = cli(server, capsys, "unload-run", other_run)
    assert rc == 1 and "is not loaded" in err
    view = admin(server, "GET", "/overview").json()
    assert not next(r for r in view["runs"] if r["run_id"] == other_run)["loaded"]
    assert f"tinker://{other_run}/weights/session-end" in {c["tinker_path"] for c in view["checkpoints"]}

    sid = session_of(trained["other_tc"])
    rc, _, _ = cli(server, capsys, "end-session", sid)
    assert rc == 0
    view = admin(server, "GET", "/overview").json()
    assert sid not in {s["session_id"] for s in view["sessions"]}
    resp = httpx.post(f"{server.base_url}/api/v1/session_heartbeat", json={"session_id": sid},
                      headers={"X-API-Key": OTHER_KEY}, timeout=30)
    assert resp.status_code == 410, resp.text
    rc, _, err = cli(server, capsys, "end-session", sid)
    assert rc == 1 and "already" in err
