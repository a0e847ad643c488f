"""`save_weights_external` and `tinker checkpoint download` through the unmodified SDK and
its CLI against `ember serve`: LoRA exports load in peft, merged LoRA (a name ending in
".merged") and full fine-tuning exports in transformers, all with the server's forward
logprobs; links are owner-bound and refuse forgeries, other files and traversal."""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
import tinker
import torch
from tinker import types

from helpers.datums import random_sft_datums, sft_datum
from ember.models.testing import target_logprobs
from helpers.server import API_KEY, MODEL_NAME, OTHER_KEY
from helpers.zygote import run_module
from ember.service.unsupported import UNSUPPORTED

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

PROBE = [5, 9, 14, 22, 31, 40, 7]
ATOL = 1e-5  # fp32 on CPU, same weights


def _train(tc) -> torch.Tensor:
    """One step (so the export differs from the base model), then the probe's logprobs."""
    tc.forward_backward(random_sft_datums(3, 84, seed=0), "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
    return tc.forward([sft_datum(PROBE)], "cross_entropy").result(timeout=120).loss_fn_outputs[0]["logprobs"].to_torch()


def _cli(server, *args: str, key: str = API_KEY) -> subprocess.CompletedProcess:
    """The SDK's own CLI (`python -m tinker.cli`, what the `tinker` script runs), forked (helpers.zygote)."""
    env = {**os.environ, "TINKER_BASE_URL": server.base_url, "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0"}
    return run_module("tinker.cli", ["--format", "json", *args], env=env, timeout=300)


def _download(server, path: str, out: Path) -> Path:
    done = _cli(server, "checkpoint", "download", path, "--output", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    target = out / path.replace("tinker://", "").replace("/", "_")
    assert json.loads(done.stdout)["destination"] == str(target)
    return target


def _full_training_client(sc: tinker.ServiceClient, base_url: str) -> tinker.TrainingClient:
    """A full fine-tuning run on the SDK client's session: the SDK only creates LoRA runs,
    the protocol allows both (create_model without lora_config), and the SDK's
    TrainingClient drives either."""
    from tinker.lib.public_interfaces.training_client import fetch_training_info

    holder = sc.holder
    seq = holder.get_training_client_id()
    body = {"session_id": holder.get_session_id(), "model_seq_id": seq, "base_model": MODEL_NAME}
    with httpx.Client(base_url=base_url + "/api/v1", headers={"X-API-Key": API_KEY}, timeout=60) as http:
        rid = http.post("/create_model", json=body).json()["request_id"]
        while (res := http.post("/retrieve_future", json={"request_id": rid}).json()).get("type") == "try_again":
            pass
    assert "error" not in res, res
    info = holder.run_coroutine_threadsafe(fetch_training_info(holder, res["model_id"])).result(60)
    return tinker.TrainingClient(holder, model_seq_id=seq, model_id=res["model_id"], info=info)


@pytest.fixture(scope="module")
def lora_export(ember_server, sc):
    tc = sc.create_lora_training_client(MODEL_NAME, rank=4, seed=0).result(timeout=120)
    ref = _train(tc)
    return tc, tc.save_weights_external("lora-ex").result(timeout=120).path, ref


def test_cli_download_of_a_lora_export_loads_in_peft_with_the_server_logprobs(ember_server, lora_export, tmp_path,
                                                                               tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tc, path, ref = lora_export
    assert path == f"tinker://{tc.model_id}/external_weights/lora-ex"
    listed = {c.tinker_path: c for c in sc_rest(ember_server).list_checkpoints(tc.model_id).result().checkpoints}
    assert listed[path].checkpoint_type == "external" and listed[path].size_bytes > 0
    target = _download(ember_server, path, tmp_path)
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in target.iterdir()}
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, target).eval()
    got = target_logprobs(model, PROBE)
    plain = target_logprobs(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), PROBE)
    assert (plain - ref).abs().max() > 1e-3  # the adapter matters, so the comparison below means something
    torch.testing.assert_close(got, ref, rtol=0, atol=ATOL)


def test_cli_download_of_a_merged_lora_export_loads_in_transformers(ember_server, lora_export, tmp_path):
    from transformers import AutoModelForCausalLM

    tc, _, ref = lora_export
    path = tc.save_weights_external("lora-ex.merged").result(timeout=120).path
    target = _download(ember_server, path, tmp_path)
    assert (target / "model.safetensors").is_file() and not (target / "adapter_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    torch.testing.assert_close(target_logprobs(model, PROBE), ref, rtol=0, atol=ATOL)


def test_cli_download_of_a_full_fine_tuning_export_loads_in_transformers(ember_server, sc, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tc = _full_training_client(sc, ember_server.base_url)
    assert not tc.get_info().is_lora
    ref = _train(tc)
    path = tc.save_weights_external("full-ex").result(timeout=120).path
    target = _download(ember_server, path, tmp_path)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in target.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    torch.testing.assert_close(target_logprobs(model, PROBE), ref, rtol=0, atol=ATOL)
    assert AutoTokenizer.from_pretrained(target).encode("ab") != []


def sc_rest(server, key: str = API_KEY) -> tinker.RestClient:
    return tinker.RestClient(base_url=server.base_url, api_key=key)


def test_another_key_gets_neither_the_urls_nor_the_files(ember_server, lora_export, tmp_path):
    _, path, _ = lora_export
    urls = sc_rest(ember_server).get_external_weights_urls(path).result(timeout=60).urls
    assert set(urls) >= {"adapter_config.json", "adapter_model.safetensors"}
    with pytest.raises(tinker.NotFoundError):
        sc_rest(ember_server, OTHER_KEY).get_external_weights_urls(path).result(timeout=60)
    other = _cli(ember_server, "checkpoint", "download", path, "--output", str(tmp_path), key=OTHER_KEY)
    assert other.returncode != 0 and "not owned by this API key" in other.stdout + other.stderr
    assert list(tmp_path.iterdir()) == []  # nothing downloaded (the CLI removes its target directory)
    # The owner's link works without a key (the CLI downloads with plain urllib) ...
    assert httpx.get(urls["adapter_config.json"]).json()["r"] == 4


def _forge(url: str, **change) -> str:
    """The link with its token's parts replaced: expires, path (a tinker path) or mac."""
    head, token, file = url.rsplit("/", 2)
    expires, path_b64, mac_b64 = token.split(".")
    if "expires" in change:
        expires = str(change["expires"])
    if "path" in change:
        path_b64 = base64.urlsafe_b64encode(change["path"].encode()).decode().rstrip("=")
    if "mac" in change:
        mac_b64 = change["mac"]
    return f"{head}/{expires}.{path_b64}.{mac_b64}/{change.get('file', file)}"


def test_forged_expired_and_traversing_links_are_refused(ember_server, lora_export, sc):
    _, path, _ = lora_export
    url = sc_rest(ember_server).get_external_weights_urls(path).result(timeout=60).urls["adapter_model.safetensors"]
    assert httpx.get(url).status_code == 200
    expires = int(url.rsplit("/", 2)[1].split(".")[0])
    other_tc = sc.create_lora_training_client(MODEL_NAME, rank=2, seed=1).result(timeout=120)
    other_path = other_tc.save_weights_external("other").result(timeout=120).path
    head = url.rsplit("/", 2)[0]
    token = url.rsplit("/", 2)[1]
    refused = [
        _forge(url, mac="A" * 43),                               # made-up signature
        _forge(url, expires=expires + 10**6),                    # extended expiry
        _forge(url, expires=1),                                  # expired
        _forge(url, path=other_path),                            # another export, this signature
        _forge(url, file="config.json"),                         # a file the export does not hold
        f"{head}/{token}/..%2F..%2F..%2Fember.db",               # traversal, encoded
        f"{head}/{token}/%2e%2e/%2e%2e/%2e%2e/external_weights.key",
        f"{head}/{token}/%2Fetc%2Fpasswd",
        f"{head}/not-a-token/adapter_config.json",
    ]
    for bad in refused:
        r = httpx.get(bad)
        assert r.status_code == 404, (bad, r.status_code, r.text[:200])
        assert "download link" in r.json()["error"], (bad, r.text[:200])


def test_deleting_an_export_removes_its_files_and_revokes_its_links(ember_server, sc):
    tc = sc.create_lora_training_client(MODEL_NAME, rank=2, seed=2).result(timeout=120)
    path = tc.save_weights_external("to-delete").result(timeout=120).path
    rest = sc_rest(ember_server)
    urls = rest.get_external_weights_urls(path).result(timeout=60).urls
    on_disk = [p for p in ember_server.data_dir.rglob("adapter_model.safetensors") if "to-delete" in str(p)]
    assert len(on_disk) == 1
    rest.delete_checkpoint_from_tinker_path(path).result(timeout=60)
    assert not on_disk[0].exists()
    assert all(httpx.get(u).status_code == 404 for u in urls.values())
    with pytest.raises(tinker.NotFoundError):
        rest.get_external_weights_urls(path).result(timeout=60)


def test_bad_export_requests_are_refused_with_the_field_named(ember_server, lora_export):
    tc, path, _ = lora_export
    with pytest.raises(tinker.RequestFailedError, match="age_encryption_recipients") as err:
        tc.save_weights_external("enc", age_encryption_recipients=["age1xyz"]).result(timeout=60)
    assert err.value.category == types.RequestErrorCategory.User
    with pytest.raises(tinker.RequestFailedError, match="invalid checkpoint name"):
        tc.save_weights_external("../escape").result(timeout=60)
    with httpx.Client(base_url=ember_server.base_url + "/api/v1", headers={"X-API-Key": API_KEY}) as http:
        r = http.get(f"/training_runs/{tc.model_id}/checkpoints/weights/x/external_weights_urls")
        assert r.status_code == 400 and "external_weights/<name>" in r.json()["error"]
        r = http.post("/save_weights_external", json={"model_id": tc.model_id, "path": "x"})
        assert r.status_code == 400 and "seq_id" in r.json()["error"]


@pytest.mark.skipif("set_checkpoint_ttl_from_tinker_path" in UNSUPPORTED,
                    reason="the CLI exports a training checkpoint through a temporary export whose TTL it renews "
                           "with set_checkpoint_ttl_from_tinker_path, which this build does not implement")
def test_cli_download_of_a_training_checkpoint_exports_it(ember_server, lora_export, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tc, _, ref = lora_export
    path = tc.save_state("for-download").result(timeout=120).path
    target = _download(ember_server, path, tmp_path)
    base = AutoModelForCausalLM.from_pretrained(Path(tc.get_info().model_data.tokenizer_id), dtype=torch.float32)
    torch.testing.assert_close(target_logprobs(PeftModel.from_pretrained(base, target), PROBE), ref, rtol=0, atol=ATOL)


def test_links_carry_the_path_prefix_and_the_request_log_hides_tokens(tmp_path, tiny_model_dir):
    from fastapi.testclient import TestClient

    from ember.server.app import create_app
    from ember.server.config import ServerConfig
    from ember.service import Service, ServiceConfig

    service = Service(ServiceConfig(data_dir=tmp_path / "data", models={MODEL_NAME: str(tiny_model_dir)}))
    log = tmp_path / "requests.jsonl"
    app = create_app(service, ServerConfig(api_keys={API_KEY: "alice"}, path_prefix="pfx", request_log=str(log),
                                               request_log_bodies=True),
                     close_service=True)
    with TestClient(app, base_url="http://ember.test") as http:
        http.headers["X-API-Key"] = API_KEY

        def finished(resp) -> dict:
            while (res := http.post("/pfx/api/v1/retrieve_future", json={"request_id": resp.json()["request_id"]})
                   .json()).get("type") == "try_again":
                pass
            return res

        sid = http.post("/pfx/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}).json()["session_id"]
        model = finished(http.post("/pfx/api/v1/create_model", json={
            "session_id": sid, "model_seq_id": 0, "base_model": MODEL_NAME, "lora_config": {"rank": 2}}))
        path = finished(http.post("/pfx/api/v1/save_weights_external",
                                  json={"model_id": model["model_id"], "seq_id": 1, "path": "p"}))["path"]
        run, ckpt_id = path.removeprefix("tinker://").split("/", 1)
        urls = http.get(f"/pfx/api/v1/training_runs/{run}/checkpoints/{ckpt_id}/external_weights_urls").json()["urls"]
        url = urls["adapter_config.json"]
        assert url.startswith("http://ember.test/pfx/api/v1/external_weights/")
        del http.headers["X-API-Key"]
        assert http.get(url).json()["r"] == 2
    token = url.rsplit("/", 2)[1]
    logged = log.read_text()
    assert token not in logged and "/external_weights/<token>/adapter_config.json" in logged
    assert f"/checkpoints/{ckpt_id}/external_weights_urls" in logged  # names stay readable
