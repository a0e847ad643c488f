"""Tenant-safe model loading (hardening item 1): a base_model is a registered name or a
model directory under an operator's `--model-root`; nothing under the data directory is
reachable by path, by any spelling; registered directories are checked at start-up."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from helpers.server import API_KEY, MODEL_NAME, OTHER_KEY, future_outcome, server_env, sft_datum, start_server

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow


def _finished(http: httpx.Client, request_id: str) -> dict:
    body = future_outcome(http, request_id)
    assert "error" not in body, body
    return body


def export_full_weights(base_url: str) -> None:
    """Tenant A: a full fine-tuning run (no lora_config: the SDK only makes LoRA runs, the
    protocol allows both), exported for sampling as a complete HF model directory."""
    with httpx.Client(base_url=base_url + "/api/v1", headers={"X-API-Key": API_KEY}, timeout=60) as http:
        session = http.post("/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"})
        sid = session.json()["session_id"]
        model = _finished(http, http.post("/create_model", json={
            "session_id": sid, "model_seq_id": 0, "base_model": MODEL_NAME}).json()["request_id"])
        _finished(http, http.post("/save_weights_for_sampler", json={
            "model_id": model["model_id"], "seq_id": 1, "path": "private"}).json()["request_id"])


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    """A server whose model root is its whole work directory, data directory included: the
    data directory must stay out of reach even then."""
    work = tmp_path_factory.mktemp("model-roots")
    allowed = work / "models" / "tiny-copy"
    shutil.copytree(tiny_model_dir, allowed)
    server = start_server(tiny_model_dir, work, extra_args=["--model-root", str(work)])
    export_full_weights(server.base_url)
    exports = sorted(p.parent for p in server.data_dir.rglob("config.json"))
    assert exports, "tenant A's export must be a model directory on disk for this test to mean anything"
    b = tinker.ServiceClient(base_url=server.base_url, api_key=OTHER_KEY)
    yield server, b, exports[0], allowed, work
    b.close("success").result(timeout=30)
    server.stop()


def spellings(export: Path, server_data: Path, work: Path) -> list[str]:
    """Every way of naming tenant A's exported weights by path."""
    link = work / "models" / "innocent-looking"
    if not link.exists():
        link.symlink_to(export, target_is_directory=True)
    rel = os.path.relpath(export, Path.cwd())
    return [
        str(export),                                                   # plain absolute
        rel,                                                           # relative to the server's cwd
        str(work / "models" / ".." / export.relative_to(work)),        # with ..
        str(link),                                                     # a symlink under the model root
        urllib.parse.quote(str(export), safe=""),                      # URL-encoded
        str(server_data) + "/checkpoints/../" + str(export.relative_to(server_data)),  # data-dir path
        str(export) + "/",                                             # trailing slash
    ]


def test_tenant_b_cannot_train_on_or_sample_tenant_a_weights_by_any_path(setup):
    server, b, export, _, work = setup
    for name in spellings(export, server.data_dir, work):
        with pytest.raises(Exception, match="unknown base model"):
            b.create_lora_training_client(base_model=name, rank=2).result()
        with pytest.raises(Exception, match="unknown base model"):
            b.create_sampling_client(base_model=name).sample(
                types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)).result()


def test_a_model_directory_under_a_model_root_works_by_path(setup):
    _, b, _, allowed, _ = setup
    tc = b.create_lora_training_client(base_model=str(allowed), rank=2).result()
    out = tc.forward_backward([sft_datum([1, 2, 3])], "cross_entropy").result()
    assert out.loss_fn_outputs


def test_an_unregistered_directory_outside_the_roots_is_refused(setup, tiny_model_dir, tmp_path):
    _, b, *_ = setup
    outside = tmp_path / "outside"  # tiny_model_dir itself is registered: its path names that model
    shutil.copytree(tiny_model_dir, outside)
    with pytest.raises(Exception, match="unknown base model"):
        b.create_lora_training_client(base_model=str(outside), rank=2).result()


def test_without_a_model_root_only_registered_names_work(tiny_model_dir, tmp_path):
    server = start_server(tiny_model_dir, tmp_path)
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    unregistered = tmp_path / "unregistered"
    shutil.copytree(tiny_model_dir, unregistered)
    try:
        with pytest.raises(Exception, match="needs the operator's --model-root"):
            sc.create_lora_training_client(base_model=str(unregistered), rank=2).result()
        sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()  # the name still works
        # and so does the directory it was registered with (tinker-cookbook's model_name)
        tc = sc.create_lora_training_client(base_model=str(tiny_model_dir), rank=2).result()
        assert tc.get_info().model_data.model_name == MODEL_NAME
    finally:
        sc.close("success").result(timeout=30)
        server.stop()


@pytest.mark.parametrize("make, words", [
    (lambda d: d / "missing", ["model 'm'", "does not exist"]),
    (lambda d: d, ["model 'm'", "not a model directory (no config.json)"]),
])
def test_a_bad_model_registration_exits_2_at_start_up(tmp_path, make, words):
    target = make(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "ember.cli", "serve", "--model", f"m={target}", "--data-dir",
                           str(tmp_path / "data"), "--port", "0"], capture_output=True, text=True, timeout=120,
                          env=server_env())
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("ember serve: ") and all(w in line for w in words), proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_model_root_that_is_not_a_directory_exits_2_at_start_up(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ember.cli", "serve", "--model-root", str(tmp_path / "nowhere"),
                           "--data-dir", str(tmp_path / "data"), "--port", "0"], capture_output=True, text=True,
                          timeout=120, env=server_env())
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("ember serve: ") and line.endswith(
        f"model root {str(tmp_path / 'nowhere')!r} is not a directory"), proc.stderr
