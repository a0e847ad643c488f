"""optim_step is exactly torch AdamW (+ clipping), refuses non-finite gradients, trains the right weights."""

import math

import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, NonFiniteGradientError, TorchEngine
from helpers.datums import random_sft_datums
from ember.models import load_model

ADAM = types.AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.5)


def test_optim_step_equals_torch_adamw_with_clipping(tiny_model_dir):
    """Same gradient in, same update out: the engine's step vs torch AdamW + clip_grad_norm_."""
    datums = random_sft_datums(4, vocab=84, seed=7)
    engine = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(micro_batch_tokens=16))
    names = list(engine.state_tensors())
    ref = {n: torch.nn.Parameter(p.detach().clone()) for n, p in engine.state_tensors().items()}
    opt = torch.optim.AdamW(ref.values(), lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2),
                            eps=ADAM.eps, weight_decay=ADAM.weight_decay)
    for _ in range(3):
        engine.forward_backward(datums, "cross_entropy")
        for n in names:
            ref[n].grad = engine.state_tensors()[n].grad.detach().clone()
        norm = torch.nn.utils.clip_grad_norm_(ref.values(), ADAM.grad_clip_norm)
        opt.step()
        opt.zero_grad()
        metrics = engine.optim_step(ADAM)
        assert metrics["grad_norm:mean"] == pytest.approx(float(norm), rel=1e-6)
    assert metrics["step:max"] == 3 and all(k.count(":") == 1 for k in metrics)
    for n, p in engine.state_tensors().items():
        torch.testing.assert_close(p.detach(), ref[n].detach(), rtol=1e-6, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


def test_non_finite_gradient_is_refused_and_nothing_changes(tiny_model_dir):
    engine = TorchEngine.from_pretrained(tiny_model_dir)
    datums = random_sft_datums(2, vocab=84, seed=1)
    engine.forward_backward(datums, "cross_entropy")
    engine.optim_step(types.AdamParams(learning_rate=1e-3))
    before = {n: p.detach().clone() for n, p in engine.state_tensors().items()}
    opt_before = {k: v.clone() for k, v in engine.optimizer.state[next(iter(engine.state_tensors().values()))].items()}
    engine.forward_backward(datums, "cross_entropy")
    p0 = next(iter(engine.state_tensors().values()))
    p0.grad[0].fill_(float("nan"))
    with pytest.raises(NonFiniteGradientError, match="non-finite gradient"):
        engine.optim_step(types.AdamParams(learning_rate=1e-3))
    for n, p in engine.state_tensors().items():
        assert torch.equal(p.detach(), before[n]), n
    for k, v in engine.optimizer.state[p0].items():
        assert torch.equal(v, opt_before[k]), k
    assert engine.step == 1
    engine.forward_backward(datums, "cross_entropy")  # still usable afterwards
    assert math.isfinite(engine.optim_step(types.AdamParams(learning_rate=1e-3))["grad_norm:mean"])


def test_lora_changes_only_adapter_weights(tiny_model_dir):
    engine = TorchEngine.from_pretrained(tiny_model_dir, lora_config=types.LoraConfig(rank=4, seed=0))
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    datums = random_sft_datums(3, vocab=84, seed=4)
    for _ in range(2):
        engine.forward_backward(datums, "cross_entropy")
        engine.optim_step(types.AdamParams(learning_rate=1e-2))
    changed = {n for n, p in engine.model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert any("lora_A" in n for n in changed) and any("lora_B" in n for n in changed)
    names = [n for n, _ in engine.named_weights()]
    assert names and all("lora_" in n and ".default." not in n for n in names)


def test_full_fine_tuning_changes_all_weights(tiny_model_dir):
    engine = TorchEngine.from_pretrained(tiny_model_dir)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    datums = random_sft_datums(4, vocab=84, seed=4)
    engine.forward_backward(datums, "cross_entropy")
    engine.optim_step(types.AdamParams(learning_rate=1e-2))
    unchanged = [n for n, p in engine.model.named_parameters() if torch.equal(p.detach(), before[n])]
    # Embedding rows of tokens never seen get no gradient, but every tensor moves.
    assert unchanged == []


def test_bad_adam_params(tiny_model_dir):
    engine = TorchEngine.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="beta2"):
        engine.optim_step(types.AdamParams(beta2=1.5))


def test_two_adapters_on_one_base_are_independent(tiny_model_dir):
    from ember.models import add_lora_adapter

    base = load_model(tiny_model_dir)
    shared = add_lora_adapter(base, "a", types.LoraConfig(rank=2, seed=1))
    shared = add_lora_adapter(shared, "b", types.LoraConfig(rank=4, seed=2))
    ea = TorchEngine(shared, lora_config=types.LoraConfig(rank=2, seed=1), adapter_name="a")
    eb = TorchEngine(shared, lora_config=types.LoraConfig(rank=4, seed=2), adapter_name="b")
    datums = random_sft_datums(2, vocab=84, seed=9)
    b_before = {n: t for n, t in eb.named_weights()}
    ea.forward_backward(datums, "cross_entropy")
    eb.forward_backward(datums, "cross_entropy")  # interleaved: grads stay per adapter
    ea.optim_step(types.AdamParams(learning_rate=1e-2))
    for n, t in eb.named_weights():
        assert torch.equal(t, b_before[n])
    assert eb.status().accumulated_micro_batches == 1
    out_a = ea.forward(datums, "cross_entropy").metrics["loss:sum"]
    out_b = eb.forward(datums, "cross_entropy").metrics["loss:sum"]
    assert out_a != out_b
