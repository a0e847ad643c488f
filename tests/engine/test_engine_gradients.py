"""Contract 2: the gradient is ∇ Σ loss(datum), whatever the micro-batching, packing or split."""

import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from helpers.datums import assert_tensors_close, random_rl_datums, random_sft_datums

RTOL = 1e-5


def _grads(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in engine.state_tensors().items() if p.grad is not None}


def _assert_same(a: dict, b: dict) -> None:
    assert_tensors_close(a, b, rtol=RTOL)


@pytest.fixture(scope="module")
def datums():
    return random_sft_datums(7, vocab=84, min_len=2, max_len=15, seed=1)


def _engine(model_dir, budget, packing=True, lora=None):
    return TorchEngine.from_pretrained(model_dir, EngineConfig(micro_batch_tokens=budget, packing=packing), lora_config=lora)


def test_micro_batch_budgets_give_identical_gradients(tiny_model_dir, datums):
    total = sum(d.model_input.length for d in datums)
    ref_engine = _engine(tiny_model_dir, budget=total)
    ref_out = ref_engine.forward_backward(datums, "cross_entropy")
    ref = _grads(ref_engine)
    for budget in (1, 9, 20, total // 2):
        e = _engine(tiny_model_dir, budget=budget)
        out = e.forward_backward(datums, "cross_entropy")
        assert e.status().accumulated_micro_batches >= 1
        _assert_same(ref, _grads(e))
        assert out.metrics["loss:sum"] == pytest.approx(ref_out.metrics["loss:sum"], rel=RTOL)


def test_budget_of_one_token_runs_one_datum_per_micro_batch(tiny_model_dir, datums):
    e = _engine(tiny_model_dir, budget=1)
    e.forward_backward(datums, "cross_entropy")
    assert e.status().accumulated_micro_batches == len(datums)
    assert e.status().accumulated_datums == len(datums)


def test_split_over_calls_equals_one_call(tiny_model_dir, datums):
    one = _engine(tiny_model_dir, budget=10_000)
    one.forward_backward(datums, "cross_entropy")
    split = _engine(tiny_model_dir, budget=10_000)
    split.forward_backward(datums[:3], "cross_entropy")
    split.forward_backward(datums[3:5], "cross_entropy")
    split.forward_backward(datums[5:], "cross_entropy")
    _assert_same(_grads(one), _grads(split))


def test_padding_and_packing_agree(tiny_model_dir, datums):
    packed = _engine(tiny_model_dir, budget=40, packing=True)
    padded = _engine(tiny_model_dir, budget=40, packing=False)
    a = packed.forward_backward(datums, "cross_entropy")
    b = padded.forward_backward(datums, "cross_entropy")
    _assert_same(_grads(packed), _grads(padded))
    for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs):
        torch.testing.assert_close(x["logprobs"].to_torch(), y["logprobs"].to_torch(), rtol=RTOL, atol=1e-6)


@pytest.mark.parametrize("loss_fn", ["ppo", "importance_sampling"])
def test_rl_losses_and_lora_are_invariant_too(tiny_model_dir, loss_fn):
    datums = random_rl_datums(5, vocab=84, seed=3)
    lora = types.LoraConfig(rank=4, seed=1)
    ref = _engine(tiny_model_dir, budget=10_000, lora=lora)
    ref.forward_backward(datums, loss_fn)
    g_ref = _grads(ref)
    small = _engine(tiny_model_dir, budget=5, lora=lora)
    small.forward_backward(datums[:2], loss_fn)
    small.forward_backward(datums[2:], loss_fn)
    _assert_same(g_ref, _grads(small))
