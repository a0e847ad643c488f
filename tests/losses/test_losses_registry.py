"""The registry against the tinker SDK's own list of loss names, plus the diagnostics helper."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch
from tinker import types

from ember import losses
from ember.losses import LOSSES, UNSUPPORTED, LossSpec, clip_diagnostics, compute_loss, get_loss


VALUE_LOSSES = {"value_mse", "ppo_value"}  # ember's, for scalar-head runs; not SDK names


def test_registry_covers_every_sdk_loss_name():
    sdk_names = set(typing.get_args(types.LossFnType))
    assert set(LOSSES) | set(UNSUPPORTED) == sdk_names | VALUE_LOSSES
    assert not VALUE_LOSSES & sdk_names


@pytest.mark.parametrize("name", list(LOSSES))
def test_spec_fields(name):
    spec = get_loss(name)
    assert isinstance(spec, LossSpec) and spec.name == name and spec.fn is getattr(losses, name)
    if name in VALUE_LOSSES:  # targets accepted (the SDK's custom-loss path sends them), not needed
        assert spec.required_inputs[0] == "returns" and "target_tokens" in spec.optional_inputs
    else:
        assert spec.required_inputs[0] == "target_tokens"
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.config_defaults["x"] = 1.0  # type: ignore[index]


def test_inputs_per_loss():
    assert get_loss("cross_entropy").optional_inputs == ("weights",)
    assert get_loss("cross_entropy").supports_top_k
    for name in ("importance_sampling", "ppo", "cispo", "dro"):
        assert get_loss(name).required_inputs == ("target_tokens", "logprobs", "advantages")
        assert not get_loss(name).supports_top_k
    assert get_loss("gspo").required_inputs[-1] == "sequence_ratio_mask"


def test_unknown_name_lists_known_losses():
    with pytest.raises(ValueError) as err:
        get_loss("grpo")
    message = str(err.value)
    assert "unknown loss_fn 'grpo'" in message
    assert all(name in message for name in LOSSES)


@pytest.mark.parametrize("name, reason", [("custom", "forward_backward_custom")])
def test_unsupported_sdk_names_explained(name, reason):
    with pytest.raises(ValueError, match=f"loss_fn '{name}' is not supported by ember: .*{reason}"):
        get_loss(name)


def test_non_string_name():
    with pytest.raises(ValueError, match="loss_fn must be a string, got int"):
        get_loss(3)  # type: ignore[arg-type]


def test_compute_loss_resolves_config_and_validates_it():
    logp = torch.log(torch.tensor([0.5, 0.5]))
    inputs = {
        "logprobs": torch.log(torch.tensor([0.25, 0.5])),
        "advantages": torch.tensor([1.0, 1.0]),
    }
    # r = (2, 1): default clip 1.2 -> loss -(1.2 + 1); raw config is resolved on the way.
    torch.testing.assert_close(
        compute_loss("ppo", logp, inputs, None, None), torch.tensor([-1.2, -1.0])
    )
    torch.testing.assert_close(
        compute_loss("ppo", logp, inputs, {"clip_high_threshold": 3.0}, None),
        torch.tensor([-2.0, -1.0]),
    )
    with pytest.raises(ValueError, match="unknown loss_fn_config key"):
        compute_loss("ppo", logp, inputs, {"eps": 0.2}, None)


def test_clip_diagnostics():
    logp = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5]))
    q = torch.log(torch.tensor([0.25, 0.25, 1.0, 1.0, 0.5]))  # r = 2, 2, 0.5, 0.5, 1
    adv = torch.tensor([1.0, -1.0, -1.0, 0.0, 1.0])
    inputs = {"logprobs": q, "advantages": adv, "sequence_ratio_mask": torch.ones(5)}
    # ppo: token 0 (A>0, r>1.2) and token 2 (A<0, r<0.8) lose their gradient.
    assert clip_diagnostics("ppo", logp, inputs, None, None) == {"clipped_tokens:sum": 2.0}
    # cispo 0.9/1.1: tokens 0, 1, 2 have A != 0 and a clipped weight.
    cfg = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    assert clip_diagnostics("cispo", logp, inputs, cfg, None) == {"clipped_tokens:sum": 3.0}
    # gspo, one datum: s = exp(mean log r) = 1 -> nothing clipped; two datums: s = 2 and 0.5.
    assert clip_diagnostics("gspo", logp, inputs, None, torch.zeros(5, dtype=torch.long)) == {
        "clipped_tokens:sum": 0.0
    }
    seg = torch.tensor([0, 0, 1, 1, 1])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    got = clip_diagnostics("gspo", logp, {**inputs, "sequence_ratio_mask": mask}, None, seg)
    assert got == {"clipped_tokens:sum": 2.0}  # token 0 (s=2, A>0), token 2 (s=0.5, A<0)
    assert clip_diagnostics("importance_sampling", logp, inputs, None, None) == {}
