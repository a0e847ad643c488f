"""save_state/load_state (DCP) resume exactly; exports load in transformers and peft."""

import pytest
import torch
from peft import PeftModel
from tinker import types
from transformers import AutoModelForCausalLM

from ember.engine import EngineConfig, TorchEngine
from helpers.datums import random_sft_datums
from ember.models import load_model

ADAM = types.AdamParams(learning_rate=5e-3)


def _train(engine, datums, steps):
    for _ in range(steps):
        engine.forward_backward(datums, "cross_entropy")
        engine.optim_step(ADAM)


@pytest.mark.parametrize("lora", [None, types.LoraConfig(rank=4, seed=3)], ids=["full", "lora"])
def test_resume_with_optimizer_is_bit_identical(tiny_model_dir, tmp_path, lora):
    datums = random_sft_datums(3, vocab=84, seed=11)
    a = TorchEngine.from_pretrained(tiny_model_dir, lora_config=lora)
    _train(a, datums, 2)
    a.save_state(tmp_path / "ckpt", optimizer=True)
    _train(a, datums, 1)

    b = TorchEngine.from_pretrained(tiny_model_dir, lora_config=lora)
    b.load_state(tmp_path / "ckpt", optimizer=True)
    assert b.step == 2
    _train(b, datums, 1)
    for (na, ta), (nb, tb) in zip(a.named_weights(), b.named_weights()):
        assert na == nb
        assert torch.equal(ta, tb), na


def test_resume_without_optimizer_starts_adam_fresh(tiny_model_dir, tmp_path):
    datums = random_sft_datums(3, vocab=84, seed=11)
    a = TorchEngine.from_pretrained(tiny_model_dir)
    _train(a, datums, 2)
    a.save_state(tmp_path / "ckpt", optimizer=True)
    weights_at_save = dict(a.named_weights())
    _train(a, datums, 1)

    b = TorchEngine.from_pretrained(tiny_model_dir)
    b.load_state(tmp_path / "ckpt", optimizer=False)
    assert b.step == 0 and not b.optimizer.state
    for n, t in b.named_weights():
        assert torch.equal(t, weights_at_save[n])
    _train(b, datums, 1)
    fresh = TorchEngine.from_pretrained(tiny_model_dir)
    fresh.load_state(tmp_path / "ckpt", optimizer=False)
    _train(fresh, datums, 1)
    diffs = [not torch.equal(x, y) for (_, x), (_, y) in zip(a.named_weights(), b.named_weights())]
    assert any(diffs)  # a fresh Adam takes a different step than the restored one
    for (_, x), (_, y) in zip(b.named_weights(), fresh.named_weights()):
        assert torch.equal(x, y)


def test_load_rejects_mismatched_checkpoints(tiny_model_dir, tmp_path):
    full = TorchEngine.from_pretrained(tiny_model_dir)
    full.save_state(tmp_path / "full", optimizer=False)
    lora = TorchEngine.from_pretrained(tiny_model_dir, lora_config=types.LoraConfig(rank=2))
    with pytest.raises(ValueError, match="holds full weights"):
        lora.load_state(tmp_path / "full", optimizer=False)
    with pytest.raises(ValueError, match="without optimizer state"):
        full.load_state(tmp_path / "full", optimizer=True)
    with pytest.raises(ValueError, match="not an ember checkpoint"):
        full.load_state(tmp_path / "nothing", optimizer=False)


def test_export_hf_full_loads_in_transformers(tiny_model_dir, tmp_path):
    engine = TorchEngine.from_pretrained(tiny_model_dir)
    _train(engine, random_sft_datums(2, vocab=84, seed=1), 1)
    engine.export_hf(tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    for n, t in engine.named_weights():
        assert torch.equal(reloaded.state_dict()[n], t), n


def test_export_hf_lora_loads_in_peft(tiny_model_dir, tmp_path):
    datums = random_sft_datums(2, vocab=84, seed=1)
    engine = TorchEngine.from_pretrained(tiny_model_dir, lora_config=types.LoraConfig(rank=4, seed=2))
    _train(engine, datums, 2)
    engine.export_hf(tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(load_model(tiny_model_dir), tmp_path / "adapter")
    ids = torch.tensor([datums[0].model_input.to_ints()])
    with torch.no_grad():
        expected = engine.model(ids).logits
        got = peft_model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_save_before_the_first_optim_step_loads_with_a_fresh_optimizer(tiny_model_dir, tmp_path, lora):
    """Adam has no moments before its first step; such a checkpoint must still load with
    `optimizer=True` (it once failed with missing optimizer keys) and train on exactly
    like the run that saved it."""
    datums = random_sft_datums(3, vocab=84, seed=5)
    kwargs = {"lora_config": types.LoraConfig(rank=2, seed=1)} if lora else {}
    a = TorchEngine.from_pretrained(tiny_model_dir, **kwargs)
    a.save_state(tmp_path / "ckpt", optimizer=True)
    b = TorchEngine.from_pretrained(tiny_model_dir, **kwargs)
    b.load_state(tmp_path / "ckpt", optimizer=True)
    assert b.step == 0 and not any(b.optimizer.state.values())
    _train(a, datums, 2)
    _train(b, datums, 2)
    for (na, x), (_, y) in zip(a.named_weights(), b.named_weights(), strict=True):
        assert torch.equal(x, y), na
