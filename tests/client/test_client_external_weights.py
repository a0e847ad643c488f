"""`save_weights_external` / `get_external_weights_urls` in process: the same exports as
over HTTP, downloaded with the SDK's own download helper (the links are file:// URLs)."""

from __future__ import annotations

import pytest
import tinker
import torch
from tinker import types
from tinker.cli.commands.checkpoint import _download_external_weights

from helpers.datums import random_sft_datums, sft_datum
from ember.models.testing import target_logprobs

BASE = "ember-test/tiny-qwen3"
PROBE = [5, 9, 14, 22, 31, 40, 7]


def _train(tc) -> torch.Tensor:
    tc.forward_backward(random_sft_datums(3, 84, seed=0), "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return tc.forward([sft_datum(PROBE)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()


def _download(rest, path, dest):
    dest.mkdir()
    assert _download_external_weights(rest, path, dest, show_progress=False, format="json") > 0
    return dest


def test_a_merged_lora_export_is_a_transformers_model_with_the_engine_logprobs(make_client, tmp_path):
    from transformers import AutoModelForCausalLM

    sc = make_client()
    tc = sc.create_lora_training_client(BASE, rank=4, seed=0).result()  # attn, mlp and unembed adapters
    ref = _train(tc)
    path = tc.save_weights_external("final.merged").result().path
    target = _download(sc.create_rest_client(), path, tmp_path / "dl")
    assert not (target / "adapter_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    torch.testing.assert_close(target_logprobs(model.eval(), PROBE), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_export_downloads_with_the_sdk_helper_and_loads_with_the_engine_logprobs(make_client, tmp_path,
                                                                                tiny_model_dir, lora):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    sc = make_client()
    tc = (sc.create_lora_training_client(BASE, rank=4, seed=0) if lora else sc.create_full_training_client(BASE)).result()
    ref = _train(tc)
    path = tc.save_weights_external("ex").result().path
    assert path == f"tinker://{tc.model_id}/external_weights/ex"
    rest = sc.create_rest_client()
    assert [c.checkpoint_type for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == ["external"]
    target = _download(rest, path, tmp_path / "dl")
    if lora:
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, target)
    else:
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    torch.testing.assert_close(target_logprobs(model.eval(), PROBE), ref, rtol=0, atol=1e-5)


def test_owner_check_and_refusals_match_http(make_client, tmp_path):
    import ember

    sc = make_client()
    tc = sc.create_lora_training_client(BASE, rank=2, seed=0).result()
    path = tc.save_weights_external("ex").result().path
    rest = sc.create_rest_client()
    assert set(rest.get_external_weights_urls(path).result().urls) >= {"adapter_config.json", "adapter_model.safetensors"}
    other = ember.ServiceClient(service=sc.service, owner="someone-else").create_rest_client()
    with pytest.raises(Exception, match="not owned by this API key"):
        other.get_external_weights_urls(path).result()
    with pytest.raises(Exception, match="is an external-weights export"):
        sc.create_sampling_client(model_path=path).sample(types.ModelInput.from_ints([1, 2]), 1,
                                                          types.SamplingParams(max_tokens=2)).result()
    with pytest.raises(ValueError, match="external weights checkpoints"):
        rest.get_external_weights_urls(path.replace("external_weights", "weights"))
    with pytest.raises(tinker.RequestFailedError, match="ttl_seconds must be between 1 and"):
        tc.save_weights_external("short", ttl_seconds=-5).result()
    with pytest.raises(tinker.RequestFailedError, match="age_encryption_recipients"):
        tc.save_weights_external("enc", age_encryption_recipients=["age1x"]).result()
    rest.delete_checkpoint_from_tinker_path(path).result()
    with pytest.raises(Exception, match="not found"):
        rest.get_external_weights_urls(path).result()
