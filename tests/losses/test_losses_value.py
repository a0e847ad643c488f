"""Value losses for scalar-head runs (`value_mse`, `ppo_value`), what losses consume, and
`prepare_datums`' head/loss matching."""

from __future__ import annotations

import re

import pytest
import torch
from tinker import types

from ember.engine.batching import prepare_datums
from ember.losses import LOSSES, compute_loss, get_loss, ppo_value, resolve_config, validate_datum_inputs, value_mse

V = 84


def _v(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def test_value_mse_formula_and_grad():
    values = torch.randn(9, dtype=torch.float64, requires_grad=True)
    returns, weights = torch.randn(9, dtype=torch.float64), torch.randn(9, dtype=torch.float64)
    loss_T = value_mse(values, {"returns": returns, "weights": weights}, {})
    torch.testing.assert_close(loss_T, 0.5 * weights * (values - returns) ** 2, rtol=0, atol=1e-7)
    loss_T.sum().backward()
    torch.testing.assert_close(values.grad, weights * (values.detach() - returns), rtol=1e-6, atol=0)
    # weights default to ones; no target_tokens needed
    plain = value_mse(values.detach(), {"returns": returns}, {})
    torch.testing.assert_close(plain, 0.5 * (values.detach() - returns) ** 2, rtol=0, atol=1e-7)
    assert value_mse(values.float(), {"returns": returns.float()}, {}).dtype == torch.float32


def _literal_ppo_value(v, old, ret, w, eps):
    out = []
    for vt, ot, rt, wt in zip(v.tolist(), old.tolist(), ret.tolist(), w.tolist()):
        clipped = ot + min(max(vt - ot, -eps), eps)
        out.append(0.5 * wt * max((vt - rt) ** 2, (clipped - rt) ** 2))
    return torch.tensor(out, dtype=torch.float64)


def test_ppo_value_clips_only_outside_the_band():
    # token 0: inside the band (|V−V_old| < ε) -> plain squared error
    # token 1: outside, clipped value farther from R -> clipped branch wins, grad 0
    # token 2: outside, clipped value closer to R -> plain branch wins, grad w(V−R)
    old, ret = _v(0.0, 0.0, 0.0), _v(1.0, 1.0, -1.0)
    values = _v(0.1, 0.5, 0.5).requires_grad_()
    w = _v(1.0, 2.0, 3.0)
    inputs = {"returns": ret, "old_values": old, "weights": w}
    loss_T = ppo_value(values, inputs, {"value_clip": 0.2})
    torch.testing.assert_close(loss_T, _literal_ppo_value(values.detach(), old, ret, w, 0.2), rtol=0, atol=1e-7)
    torch.testing.assert_close(loss_T.detach(), _v(0.5 * 0.81, 0.5 * 2 * 0.64, 0.5 * 3 * 2.25), rtol=0, atol=1e-7)
    loss_T.sum().backward()
    torch.testing.assert_close(values.grad, _v(0.1 - 1.0, 0.0, 3 * 1.5), rtol=1e-6, atol=1e-12)
    # a larger ε puts every token inside the band: plain value_mse
    wide = ppo_value(values.detach(), inputs, {"value_clip": 10.0})
    torch.testing.assert_close(wide, value_mse(values.detach(), inputs, {}), rtol=0, atol=1e-12)


def test_ppo_value_matches_literal_on_random_tokens():
    g = torch.Generator().manual_seed(0)
    v, old, ret, w = (torch.randn(200, generator=g, dtype=torch.float64) for _ in range(4))
    got = ppo_value(v, {"returns": ret, "old_values": old, "weights": w}, {"value_clip": 0.3})
    torch.testing.assert_close(got, _literal_ppo_value(v, old, ret, w, 0.3), rtol=0, atol=1e-7)


def test_registry_consumes():
    for name, spec in LOSSES.items():
        if name == "cross_entropy":
            assert spec.consumes == {"logprobs", "values"}
        elif name in ("value_mse", "ppo_value"):
            assert spec.consumes == {"values"} and not spec.supports_top_k
        else:
            assert spec.consumes == {"logprobs"}, name
    assert get_loss("value_mse").required_inputs == ("returns",)
    assert get_loss("ppo_value").required_inputs == ("returns", "old_values")
    assert resolve_config("ppo_value", None) == {"value_clip": 0.2}
    for bad in (0.0, -0.1):
        with pytest.raises(ValueError, match=re.escape(f"loss_fn_config['value_clip'] must be > 0 (the clip range")):
            resolve_config("ppo_value", {"value_clip": bad})
    with pytest.raises(ValueError, match="unknown loss_fn_config key"):
        resolve_config("value_mse", {"value_clip": 0.2})


def test_compute_loss_on_values():
    values = _v(1.0, 2.0)
    got = compute_loss("ppo_value", values, {"returns": _v(0.0, 0.0), "old_values": _v(1.0, 2.0)}, None, None)
    torch.testing.assert_close(got, _v(0.5, 2.0))


# ---------------------------------------------------------------- validation
def test_value_inputs_validated_without_target_tokens():
    out = validate_datum_inputs("value_mse", 0, 4, {"returns": torch.zeros(4)}, V)
    assert set(out) == {"returns", "weights"}
    assert out["weights"].shape == (4,) and out["weights"].dtype == torch.float32
    assert bool((out["weights"] == 1).all())
    with_targets = validate_datum_inputs(
        "ppo_value", 0, 3, {"returns": torch.zeros(3), "old_values": torch.ones(3), "target_tokens": torch.arange(3)}, V
    )
    assert set(with_targets) == {"returns", "old_values", "weights", "target_tokens"}


@pytest.mark.parametrize(
    "name, inputs, match",
    [
        ("value_mse", {"weights": torch.ones(4)}, "datum 2: loss_fn_inputs is missing ['returns'], required by loss 'value_mse'"),
        ("ppo_value", {"returns": torch.ones(4), "old_values": torch.ones(3)},
         "datum 2: loss_fn_inputs['old_values'] has shape (3,), expected (4,) (N = model_input length)"),
        ("value_mse", {"returns": torch.ones(4), "weights": torch.ones(5)},
         "datum 2: loss_fn_inputs['weights'] has shape (5,), expected (4,)"),
        ("value_mse", {"returns": torch.ones(4), "advantages": torch.ones(4)},
         "datum 2: loss_fn_inputs has unknown key(s) ['advantages'] for loss 'value_mse'"),
        ("value_mse", {"returns": torch.tensor([0.0, float("nan"), 0.0, 0.0])},
         "datum 2: loss_fn_inputs['returns'] has a non-finite value nan at position 1"),
        ("value_mse", {"returns": torch.ones(4), "target_tokens": torch.tensor([1, 2, 3, 99])},
         "datum 2: loss_fn_inputs['target_tokens'] has token id 99 at position 3"),
    ],
)
def test_value_loss_inputs_named_errors(name, inputs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        validate_datum_inputs(name, 2, 4, inputs, V)


# ---------------------------------------------------------------- prepare_datums and the head
def _datum(n, **inputs):
    return types.Datum(
        model_input=types.ModelInput.from_ints(list(range(1, n + 1))),
        loss_fn_inputs={k: types.TensorData.from_torch(v) for k, v in inputs.items()},
    )


def test_prepare_datums_refuses_a_loss_the_head_does_not_output():
    value_datum = _datum(3, returns=torch.zeros(3))
    policy_datum = _datum(3, target_tokens=torch.tensor([1, 2, 3]), logprobs=torch.zeros(3), advantages=torch.ones(3))
    with pytest.raises(ValueError) as err:
        prepare_datums([value_datum], get_loss("value_mse"), V)  # default output: a policy
    msg = str(err.value)
    assert "loss_fn 'value_mse' consumes values, but this run has a policy head" in msg
    assert "Losses for a policy head: cispo, cross_entropy, dro, gspo, importance_sampling, ppo" in msg
    with pytest.raises(ValueError) as err:
        prepare_datums([policy_datum], get_loss("ppo"), V, output="values")
    msg = str(err.value)
    assert "loss_fn 'ppo' consumes logprobs, but this run has a value head (user_metadata {'ember.head': 'value'})" in msg
    assert "Losses for a value head: cross_entropy, ppo_value, value_mse" in msg
    with pytest.raises(ValueError, match="head output must be one of"):
        prepare_datums([value_datum], get_loss("value_mse"), V, output="scores")


def test_prepare_datums_on_a_value_head():
    datums = [
        _datum(3, returns=torch.zeros(3)),
        _datum(2, returns=torch.ones(2), target_tokens=torch.tensor([4, 5]), weights=torch.tensor([0.5, 2.0])),
    ]
    prepared = prepare_datums(datums, get_loss("value_mse"), V, output="values")
    assert [set(p.inputs) for p in prepared] == [{"returns", "weights"}] * 2  # targets are not read
    assert prepared[1].inputs["weights"].tolist() == [0.5, 2.0]
    # cross_entropy on a value head: 1-D targets fine, top-K refused with the datum index
    ce = [_datum(2, target_tokens=torch.tensor([1, 2])),
          _datum(2, target_tokens=torch.tensor([[1, 2], [3, 4]]), weights=torch.ones(2, 2))]
    assert len(prepare_datums(ce[:1], get_loss("cross_entropy"), V, output="values")) == 1
    with pytest.raises(ValueError, match=re.escape(
            "datum 1: loss_fn_inputs['target_tokens'] has shape (2, 2); a value head has one output per position, use (2,)")):
        prepare_datums(ce, get_loss("cross_entropy"), V, output="values")
    # a policy run keeps today's behaviour: mixed target ranks refused
    with pytest.raises(ValueError, match="same rank"):
        prepare_datums(ce, get_loss("cross_entropy"), V)
