"""`validate_datum_inputs`: every check, each error naming the datum index and field."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from tinker import types

from ember.losses import validate_datum_inputs

V = 84  # vocab size of the tiny test tokenizer
N = 8


def rl_inputs(n=N, **overrides):
    inputs = {
        "target_tokens": torch.arange(n, dtype=torch.int64),
        "logprobs": -torch.rand(n),
        "advantages": torch.randn(n),
    }
    inputs.update(overrides)
    return inputs


def ce_inputs(n=N, **overrides):
    inputs = {"target_tokens": torch.arange(n, dtype=torch.int64), "weights": torch.ones(n)}
    inputs.update(overrides)
    return inputs


def raises(match: str):
    return pytest.raises(ValueError, match=re.escape(match))


# ---------------------------------------------------------------- happy paths
def test_cross_entropy_missing_weights_become_ones():
    out = validate_datum_inputs("cross_entropy", 0, N, {"target_tokens": torch.arange(N)}, V)
    assert out["weights"].dtype == torch.float32 and torch.equal(out["weights"], torch.ones(N))
    top_k = validate_datum_inputs(
        "cross_entropy", 0, N, {"target_tokens": torch.zeros(N, 3, dtype=torch.long)}, V
    )
    assert top_k["weights"].shape == (N, 3)


def test_floats_converted_to_float32_and_input_not_mutated():
    raw = rl_inputs(advantages=torch.randn(N, dtype=torch.float64), logprobs=-torch.rand(N).half())
    out = validate_datum_inputs("ppo", 0, N, raw, V)
    assert {k: v.dtype for k, v in out.items()} == {
        "target_tokens": torch.int64,
        "logprobs": torch.float32,
        "advantages": torch.float32,
    }
    assert raw["advantages"].dtype == torch.float64
    torch.testing.assert_close(out["advantages"], raw["advantages"].float())


def test_gspo_needs_sequence_ratio_mask():
    with raises(
        "datum 2: loss_fn_inputs is missing ['sequence_ratio_mask'], required by loss 'gspo'"
    ):
        validate_datum_inputs("gspo", 2, N, rl_inputs(), V)
    out = validate_datum_inputs("gspo", 2, N, rl_inputs(sequence_ratio_mask=torch.ones(N)), V)
    assert set(out) == {"target_tokens", "logprobs", "advantages", "sequence_ratio_mask"}


def test_sdk_datum_round_trip_including_sparse_top_k():
    """Inputs as the tinker SDK builds them (lists cast by key; 2-D torch auto-sparsified)."""
    rl = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(5))),
        loss_fn_inputs={
            "target_tokens": [1, 2, 3, 4, 5],
            "logprobs": [-0.1] * 5,
            "advantages": np.array([0, 0, 1, 1, 1]),
        },  # int numpy stays int64
    )
    inputs = {k: v.to_torch() for k, v in rl.loss_fn_inputs.items()}
    with raises("datum 0: loss_fn_inputs['advantages'] has dtype int64, expected a float tensor"):
        validate_datum_inputs("importance_sampling", 0, rl.model_input.length, inputs, V)
    inputs["advantages"] = inputs["advantages"].float()
    assert validate_datum_inputs("importance_sampling", 0, 5, inputs, V)[
        "target_tokens"
    ].tolist() == [1, 2, 3, 4, 5]

    tokens = torch.zeros(4, 8, dtype=torch.long)
    tokens[:, 0] = torch.tensor([5, 6, 7, 8])
    weights = (tokens != 0).float()
    top_k = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": tokens, "weights": weights},
    )
    assert top_k.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None
    out = validate_datum_inputs(
        "cross_entropy", 0, 4, {k: v.to_torch() for k, v in top_k.loss_fn_inputs.items()}, V
    )
    assert torch.equal(out["target_tokens"], tokens) and torch.equal(out["weights"], weights)


def test_torch_sparse_tensors_are_densified():
    tokens = torch.tensor([[3, 0], [0, 4]]).to_sparse_csr()
    out = validate_datum_inputs("cross_entropy", 0, 2, {"target_tokens": tokens}, V)
    assert out["target_tokens"].layout == torch.strided
    assert out["target_tokens"].tolist() == [[3, 0], [0, 4]]


# ---------------------------------------------------------------- key checks
def test_missing_required_key():
    raw = rl_inputs()
    del raw["advantages"]
    with raises("datum 3: loss_fn_inputs is missing ['advantages'], required by loss 'ppo'"):
        validate_datum_inputs("ppo", 3, N, raw, V)
    with raises(
        "datum 0: loss_fn_inputs is missing ['target_tokens'], required by loss 'cross_entropy'"
    ):
        validate_datum_inputs("cross_entropy", 0, N, {"weights": torch.ones(N)}, V)


def test_unknown_key():
    with raises("datum 3: loss_fn_inputs has unknown key(s) ['mask'] for loss 'ppo'"):
        validate_datum_inputs("ppo", 3, N, rl_inputs(mask=torch.ones(N)), V)
    # RL losses take no weights in Tinker (masking is zero advantages).
    with raises(
        "datum 1: loss_fn_inputs has unknown key(s) ['weights'] for loss 'importance_sampling'"
    ):
        validate_datum_inputs("importance_sampling", 1, N, rl_inputs(weights=torch.ones(N)), V)


def test_clip_threshold_as_input_points_to_loss_fn_config():
    with pytest.raises(
        ValueError, match=r"datum 4: .*\['clip_low_threshold'\] belong in loss_fn_config"
    ):
        validate_datum_inputs("ppo", 4, N, rl_inputs(clip_low_threshold=torch.full((N,), 0.8)), V)


def test_non_tensor_value():
    with raises("datum 5: loss_fn_inputs['advantages'] must be a torch.Tensor, got list"):
        validate_datum_inputs("ppo", 5, N, rl_inputs(advantages=[0.0] * N), V)


# ---------------------------------------------------------------- target_tokens
def test_target_tokens_length_mismatch():
    with raises(
        "datum 3: loss_fn_inputs['target_tokens'] has shape (7,), expected (8,) "
        "(first dim = model_input length)"
    ):
        validate_datum_inputs("cross_entropy", 3, N, {"target_tokens": torch.arange(7)}, V)


def test_target_tokens_dtype():
    with raises("datum 1: loss_fn_inputs['target_tokens'] has dtype float32, expected int64"):
        validate_datum_inputs("cross_entropy", 1, N, {"target_tokens": torch.zeros(N)}, V)
    with raises("datum 1: loss_fn_inputs['target_tokens'] has dtype int32, expected int64"):
        validate_datum_inputs(
            "ppo", 1, N, rl_inputs(target_tokens=torch.zeros(N, dtype=torch.int32)), V
        )


@pytest.mark.parametrize("bad, position", [(V, "5"), (-1, "5"), (10_000, "5")])
def test_target_tokens_out_of_vocab(bad, position):
    tokens = torch.arange(N)
    tokens[5] = bad
    with raises(
        f"datum 6: loss_fn_inputs['target_tokens'] has token id {bad} at position {position}, "
        f"outside [0, vocab_size={V})"
    ):
        validate_datum_inputs("ppo", 6, N, rl_inputs(target_tokens=tokens), V)


def test_top_k_out_of_vocab_reports_row_and_column():
    tokens = torch.zeros(N, 3, dtype=torch.long)
    tokens[2, 1] = V + 3
    with raises(
        f"datum 0: loss_fn_inputs['target_tokens'] has token id {V + 3} at position (2, 1)"
    ):
        validate_datum_inputs("cross_entropy", 0, N, {"target_tokens": tokens}, V)


def test_top_k_only_for_cross_entropy():
    tokens = torch.zeros(N, 2, dtype=torch.long)
    with raises(
        "datum 2: loss_fn_inputs['target_tokens'] has shape (8, 2), expected (N,) with N=8 "
        "(only cross_entropy takes (N, K) targets)"
    ):
        validate_datum_inputs("ppo", 2, N, rl_inputs(target_tokens=tokens), V)


@pytest.mark.parametrize("shape", [(), (N, 2, 2), (N, 0)])
def test_target_tokens_bad_rank(shape):
    with pytest.raises(ValueError, match=r"datum 7: loss_fn_inputs\['target_tokens'\] has shape"):
        validate_datum_inputs(
            "cross_entropy", 7, N, {"target_tokens": torch.zeros(shape, dtype=torch.long)}, V
        )


def test_empty_model_input():
    with raises("datum 9: model_input is empty"):
        validate_datum_inputs(
            "cross_entropy", 9, 0, {"target_tokens": torch.zeros(0, dtype=torch.long)}, V
        )


# ---------------------------------------------------------------- float inputs
def test_weights_shape_must_match_target_tokens():
    with raises(
        "datum 3: loss_fn_inputs['weights'] has shape (7,), expected (8,) (same as target_tokens)"
    ):
        validate_datum_inputs("cross_entropy", 3, N, ce_inputs(weights=torch.ones(7)), V)
    with raises(
        "datum 3: loss_fn_inputs['weights'] has shape (8,), expected (8, 4) (same as target_tokens)"
    ):
        validate_datum_inputs(
            "cross_entropy", 3, N, ce_inputs(target_tokens=torch.zeros(N, 4, dtype=torch.long)), V
        )


def test_weights_dtype():
    with raises("datum 0: loss_fn_inputs['weights'] has dtype int64, expected a float tensor"):
        validate_datum_inputs(
            "cross_entropy", 0, N, ce_inputs(weights=torch.ones(N, dtype=torch.long)), V
        )


@pytest.mark.parametrize("key", ["logprobs", "advantages", "sequence_ratio_mask"])
def test_rl_float_inputs_shape_and_dtype(key):
    good = rl_inputs(sequence_ratio_mask=torch.ones(N))
    with raises(
        f"datum 4: loss_fn_inputs['{key}'] has shape (9,), expected (8,) (N = model_input length)"
    ):
        validate_datum_inputs("gspo", 4, N, {**good, key: torch.zeros(9)}, V)
    with raises(f"datum 4: loss_fn_inputs['{key}'] has shape (8, 1), expected (8,)"):
        validate_datum_inputs("gspo", 4, N, {**good, key: torch.zeros(N, 1)}, V)
    with raises(f"datum 4: loss_fn_inputs['{key}'] has dtype int64, expected a float tensor"):
        validate_datum_inputs("gspo", 4, N, {**good, key: torch.zeros(N, dtype=torch.long)}, V)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize(
    "name, key", [("ppo", "advantages"), ("dro", "logprobs"), ("cross_entropy", "weights")]
)
def test_non_finite_values(name, key, value):
    raw = ce_inputs() if name == "cross_entropy" else rl_inputs()
    raw[key] = raw[key].clone()
    raw[key][6] = value
    with raises(f"datum 8: loss_fn_inputs['{key}'] has a non-finite value {value} at position 6"):
        validate_datum_inputs(name, 8, N, raw, V)


def test_float64_overflowing_float32_is_non_finite():
    with raises("datum 0: loss_fn_inputs['advantages'] has a non-finite value inf at position 0"):
        validate_datum_inputs(
            "ppo", 0, N, rl_inputs(advantages=torch.full((N,), 1e300, dtype=torch.float64)), V
        )


def test_unknown_loss_name():
    with raises("unknown loss_fn 'sft'"):
        validate_datum_inputs("sft", 0, N, ce_inputs(), V)


# ---------------------------------------------------------------- one scan over many datums
def test_first_bad_datum_finds_the_earliest_bad_value_across_fields():
    from ember.losses.validation import first_bad_datum

    clean = [validate_datum_inputs("importance_sampling", i, n, rl_inputs(n), V, scan_values=False)
             for i, n in enumerate([3, 1, 5, 2, 4])]
    assert first_bad_datum(clean, V) is None
    bad = [dict(d) for d in clean]
    bad[4]["target_tokens"] = torch.tensor([0, 1, 2, V, 3])  # out of vocabulary, datum 4
    bad[2]["advantages"] = torch.tensor([0.0, 0.0, 0.0, 0.0, float("nan")])  # last value of datum 2
    assert first_bad_datum(bad, V) == 2
    bad[1]["logprobs"] = torch.tensor([float("inf")])  # a one-token datum
    assert first_bad_datum(bad, V) == 1
    only_some = [{"target_tokens": torch.tensor([1])}, {"target_tokens": torch.tensor([1]),
                                                       "weights": torch.tensor([float("nan")])}]
    assert first_bad_datum(only_some, V) == 1


def test_scan_values_false_skips_only_the_value_checks():
    inputs = rl_inputs(advantages=torch.full((N,), float("nan")), target_tokens=torch.full((N,), V))
    out = validate_datum_inputs("importance_sampling", 0, N, inputs, V, scan_values=False)
    assert out["advantages"].dtype == torch.float32
    with raises("datum 0: loss_fn_inputs['target_tokens'] has token id 84 at position 0"):
        validate_datum_inputs("importance_sampling", 0, N, inputs, V)
    with raises("datum 0: loss_fn_inputs['logprobs'] has shape (7,), expected (8,)"):
        validate_datum_inputs("importance_sampling", 0, N, rl_inputs(logprobs=torch.zeros(N - 1)), V,
                              scan_values=False)


# ---------------------------------------------------------------- value losses (scalar heads)
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
    with raises(match):
        validate_datum_inputs(name, 2, 4, inputs, V)
