"""`resolve_config`: defaults, overrides and every rejection rule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ember.losses import LOSSES, resolve_config

EXPECTED_DEFAULTS = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.1},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "stable_reinforce": {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0},
    "value_mse": {},
    "ppo_value": {"value_clip": 0.2},
}


@pytest.mark.parametrize("name", list(EXPECTED_DEFAULTS))
@pytest.mark.parametrize("given", [None, {}])
def test_defaults(name, given):
    assert resolve_config(name, given) == EXPECTED_DEFAULTS[name]


def test_every_registered_loss_has_expected_defaults():
    assert set(LOSSES) == set(EXPECTED_DEFAULTS)


def test_override_is_partial_and_does_not_mutate_registry():
    resolved = resolve_config("ppo", {"clip_high_threshold": 1.5})
    assert resolved == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.5}
    resolved["clip_low_threshold"] = 0.0
    assert resolve_config("ppo", None)["clip_low_threshold"] == 0.8
    assert LOSSES["ppo"].config_defaults["clip_low_threshold"] == 0.8


def test_ints_and_numpy_scalars_become_floats_and_resolution_is_idempotent():
    resolved = resolve_config(
        "cispo", {"clip_low_threshold": 0, "clip_high_threshold": np.float32(2.5)}
    )
    assert resolved == {"clip_low_threshold": 0.0, "clip_high_threshold": 2.5}
    assert all(type(v) is float for v in resolved.values())
    assert resolve_config("cispo", resolved) == resolved


@pytest.mark.parametrize(
    "name, config, accepted",
    [
        ("ppo", {"clip_ratio": 0.2}, "clip_high_threshold, clip_low_threshold"),
        ("cross_entropy", {"clip_low_threshold": 0.8}, "none"),
        ("importance_sampling", {"beta": 0.1}, "none"),
        ("dro", {"clip_low_threshold": 0.8, "betta": 1.0}, "beta"),
    ],
)
def test_unknown_keys_are_named_with_accepted_keys(name, config, accepted):
    with pytest.raises(ValueError) as err:
        resolve_config(name, config)
    message = str(err.value)
    for key in config:
        if key not in LOSSES[name].config_defaults:
            assert repr(key) in message
    assert f"accepted keys: {accepted}" in message and repr(name) in message


@pytest.mark.parametrize("value", ["0.9", None, True, [0.9], b"1"])
def test_non_numeric_values_rejected(value):
    with pytest.raises(
        ValueError, match=r"loss_fn_config\['clip_low_threshold'\] must be a number"
    ):
        resolve_config("ppo", {"clip_low_threshold": value})


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, np.float32("nan")])
def test_non_finite_values_rejected(value):
    with pytest.raises(ValueError, match=r"loss_fn_config\['beta'\] must be finite"):
        resolve_config("dro", {"beta": value})


@pytest.mark.parametrize(
    "name, config",
    [
        ("ppo", {"clip_low_threshold": 1.3, "clip_high_threshold": 1.2}),
        ("ppo", {"clip_high_threshold": 0.5}),  # below the default low of 0.8
        ("gspo", {"clip_low_threshold": -0.1}),
        ("cispo", {"clip_low_threshold": 5.0}),  # above the default high of 4.0
    ],
)
def test_clip_thresholds_out_of_order(name, config):
    with pytest.raises(ValueError, match="0 <= clip_low_threshold <= clip_high_threshold") as err:
        resolve_config(name, config)
    resolved_low = config.get(
        "clip_low_threshold", LOSSES[name].config_defaults["clip_low_threshold"]
    )
    assert f"clip_low_threshold={float(resolved_low)}" in str(err.value)


def test_equal_thresholds_and_zero_beta_allowed():
    assert resolve_config("ppo", {"clip_low_threshold": 1.0, "clip_high_threshold": 1.0}) == {
        "clip_low_threshold": 1.0,
        "clip_high_threshold": 1.0,
    }
    assert resolve_config("dro", {"beta": 0}) == {"beta": 0.0}


def test_negative_beta_rejected():
    with pytest.raises(ValueError, match=r"'beta'\] must be >= 0, got -0.5"):
        resolve_config("dro", {"beta": -0.5})


def test_unknown_loss_rejected():
    with pytest.raises(ValueError, match="unknown loss_fn 'grpo'"):
        resolve_config("grpo", None)
