"""Every built-in loss through the engine: loss:sum matches the formula, and so does the gradient."""

import pytest
import torch
from tinker import types

from ember.engine import TorchEngine
from helpers.datums import random_rl_datums, random_sft_datums
from ember.models import load_model


def _formula(loss_fn, logp, inp, cfg):
    """Tinker's per-datum losses (docs/protocol.md §5), written independently of ember.losses."""
    if loss_fn == "cross_entropy":
        return -(inp["weights"] * logp).sum()
    q, adv = inp["logprobs"], inp["advantages"]
    ratio = torch.exp(logp - q)
    if loss_fn == "importance_sampling":
        return -(ratio * adv).sum()
    if loss_fn == "ppo":
        lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
        return -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv).sum()
    if loss_fn == "cispo":
        lo, hi = cfg.get("clip_low_threshold", 0.0), cfg.get("clip_high_threshold", 4.0)
        return -(ratio.clamp(lo, hi).detach() * logp * adv).sum()
    if loss_fn == "dro":
        beta = cfg.get("beta", 0.1)
        return -(logp * adv - 0.5 * beta * (logp - q) ** 2).sum()
    raise AssertionError(loss_fn)


def _datums(loss_fn):
    if loss_fn == "cross_entropy":
        return random_sft_datums(4, vocab=84, seed=21)
    return random_rl_datums(4, vocab=84, seed=22)


CASES = [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {}),
    ("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}),
    ("cispo", {}),
    ("dro", {"beta": 0.3}),
]


@pytest.mark.parametrize("loss_fn,cfg", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_loss_and_gradient_match_formula(tiny_model_dir, loss_fn, cfg):
    datums = _datums(loss_fn)
    engine = TorchEngine.from_pretrained(tiny_model_dir)
    out = engine.forward_backward(datums, loss_fn, cfg)
    model = load_model(tiny_model_dir)
    total, recomputed = 0.0, 0.0
    for d, o in zip(datums, out.loss_fn_outputs):
        inp = {k: v.to_torch() for k, v in d.loss_fn_inputs.items()}
        ids = torch.tensor([d.model_input.to_ints()])
        logp = torch.log_softmax(model(ids).logits[0].float(), -1).gather(1, inp["target_tokens"].unsqueeze(1)).squeeze(1)
        loss = _formula(loss_fn, logp, inp, cfg)
        total = total + loss
        returned = o["logprobs"].to_torch()
        recomputed += float(_formula(loss_fn, returned, inp, cfg))
        torch.testing.assert_close(o["elementwise_loss"].to_torch().sum(), loss.detach(), rtol=1e-5, atol=1e-5)
    assert out.metrics["loss:sum"] == pytest.approx(recomputed, rel=1e-5, abs=1e-5)
    total.backward()
    ref = dict(model.named_parameters())
    for name, p in engine.state_tensors().items():
        torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_top_k_cross_entropy(tiny_model_dir):
    engine = TorchEngine.from_pretrained(tiny_model_dir)
    targets = torch.tensor([[3, 4, 5], [6, 7, 8]])
    weights = torch.tensor([[0.5, 0.3, 0.2], [1.0, 0.0, 0.0]])
    d = types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                    loss_fn_inputs={"target_tokens": targets, "weights": weights})
    out = engine.forward_backward([d], "cross_entropy")
    logp = out.loss_fn_outputs[0]["logprobs"].to_torch()
    assert logp.shape == (2, 3)
    assert out.metrics["loss:sum"] == pytest.approx(float(-(weights * logp).sum()), rel=1e-6)
