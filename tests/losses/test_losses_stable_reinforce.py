"""`stable_reinforce` as a pure tensor function: value and gradient against a numpy
reference (the formula in its docstring), masking by provenance and by the ratio band,
registry entry, config and input validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember.losses import compute_loss, get_loss, resolve_config, validate_datum_inputs


def reference(logp, q, adv, mask, low=0.5, high=2.0):
    """(per-token loss, closed-form d loss / d logp) in float64: loss −keep·r·A, and since
    dr/dlogp = r (keep is a stop-gradient mask) the gradient has the same value."""
    ratio = np.exp(logp - q)
    keep = ((mask != 0) & (ratio >= low) & (ratio <= high)).astype(np.float64)
    return -keep * ratio * adv, -keep * ratio * adv


def batch(seed=0, T=40):
    rng = np.random.default_rng(seed)
    logp = np.log(rng.uniform(0.05, 1.0, T))
    q = logp + rng.normal(0.0, 0.6, T)  # ratios on both sides of the band
    adv = rng.normal(0.0, 1.0, T)
    mask = (rng.uniform(size=T) < 0.7).astype(np.float64)
    return logp, q, adv, mask


@pytest.mark.parametrize("config", [None, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.25}])
def test_value_and_gradient_match_reference(config):
    logp, q, adv, mask = batch()
    low, high = (0.5, 2.0) if config is None else (0.8, 1.25)
    want_loss, want_grad = reference(logp, q, adv, mask, low, high)
    logp_t = torch.tensor(logp, requires_grad=True)
    inputs = {"logprobs": torch.tensor(q), "advantages": torch.tensor(adv), "sampled_mask": torch.tensor(mask)}
    loss = compute_loss("stable_reinforce", logp_t, inputs, config, None)
    loss.sum().backward()
    np.testing.assert_allclose(loss.detach().numpy(), want_loss, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(logp_t.grad.numpy(), want_grad, rtol=1e-12, atol=1e-12)
    ratio = np.exp(logp - q)
    outside = (mask != 0) & ((ratio < low) | (ratio > high))
    assert outside.any() and (mask == 0).any()  # both kinds of masking were exercised
    assert np.all(logp_t.grad.numpy()[outside | (mask == 0)] == 0)


def test_on_policy_is_plain_reinforce():
    """q = logp: r = 1, every sampled token kept; loss −Σ A on the sampled rows, gradient −A."""
    logp = torch.log(torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64)).requires_grad_()
    inputs = {"logprobs": logp.detach().clone(), "advantages": torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64),
              "sampled_mask": torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64)}
    loss = compute_loss("stable_reinforce", logp, inputs, None, None)
    loss.sum().backward()
    torch.testing.assert_close(loss.detach(), torch.tensor([0.0, 2.0, -3.0], dtype=torch.float64))
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 2.0, -3.0], dtype=torch.float64))


def test_bf16_logprobs_upcast():
    logp = torch.tensor([-1.0, -2.0], dtype=torch.bfloat16)
    inputs = {"logprobs": torch.tensor([-1.0, -2.5]), "advantages": torch.tensor([1.0, 1.0]),
              "sampled_mask": torch.tensor([1.0, 1.0])}
    out = compute_loss("stable_reinforce", logp, inputs, None, None)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, -torch.exp(torch.tensor([0.0, 0.5])), rtol=1e-6, atol=1e-6)


def test_registry_and_config():
    spec = get_loss("stable_reinforce")
    assert spec.required_inputs == ("target_tokens", "logprobs", "advantages", "sampled_mask")
    assert resolve_config("stable_reinforce", None) == {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}
    with pytest.raises(ValueError, match="clip_low_threshold <= clip_high_threshold"):
        resolve_config("stable_reinforce", {"clip_low_threshold": 3.0})
    with pytest.raises(ValueError, match=r"unknown loss_fn_config key\(s\) \['kl_coeff'\]"):
        resolve_config("stable_reinforce", {"kl_coeff": 0.1})


def test_validation_names_the_mask():
    n = 3
    inputs = {"target_tokens": torch.tensor([1, 2, 3]), "logprobs": torch.zeros(n), "advantages": torch.ones(n),
              "sampled_mask": torch.ones(n + 1)}
    message = r"datum 2: loss_fn_inputs\['sampled_mask'\] has shape \(4,\), expected \(3,\)"
    with pytest.raises(ValueError, match=message):
        validate_datum_inputs("stable_reinforce", 2, n, inputs, vocab_size=8)
