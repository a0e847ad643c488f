"""A model directory rewritten under a running service is refused, naming it, not served stale."""

from __future__ import annotations

import pytest

import ember
from ember.models.testing import build_tiny_model


def test_a_model_directory_changed_on_disk_is_refused_until_restart(tmp_path):
    model = tmp_path / "tiny-model"
    build_tiny_model(model, family="qwen3", seed=0)
    sc = ember.ServiceClient(models={"tiny": str(model)}, data_dir=tmp_path / "data")
    try:
        sc.create_lora_training_client(base_model="tiny", rank=4).result()
        sc.create_sampling_client(base_model="tiny").result()
        build_tiny_model(model, family="qwen3", seed=1, tokenizer_alphabet="abc ")  # a new vocabulary
        with pytest.raises(Exception, match=r"base model 'tiny': the files of .*tiny-model changed since this "
                                            r"process loaded them \(.*config.json.*\); .*restart"):
            sc.create_lora_training_client(base_model="tiny", rank=4).result()
        with pytest.raises(Exception, match="changed since this process loaded them"):
            sc.create_sampling_client(base_model="tiny").result()
    finally:
        sc.close("success")
    fresh = ember.ServiceClient(models={"tiny": str(model)}, data_dir=tmp_path / "data2")  # a restart loads the new files
    try:
        tc = fresh.create_lora_training_client(base_model="tiny", rank=4).result()
        assert tc.get_tokenizer().encode("abc", add_special_tokens=False)
    finally:
        fresh.close("success")
