"""The sampler/trainer log-prob gap in forward_backward's metrics (ember.service.fidelity),
as a pure function on hand-made datums; through the in-process client in
tests/client/test_client_fidelity.py."""

from __future__ import annotations

import math

import pytest
import torch
from tinker import types

from ember.service.fidelity import logprob_gap_metrics

def datum(q: list[float], mask: list[float] | None = None) -> types.Datum:
    inputs = {"target_tokens": [1] * len(q), "logprobs": q, "advantages": [1.0] * len(q)}
    if mask is not None:  # not a key the SDK's Datum converts from a list
        inputs["sampled_mask"] = types.TensorData.from_torch(torch.tensor(mask))
    return types.Datum(model_input=types.ModelInput.from_ints([0] * len(q)), loss_fn_inputs=inputs)


def out(p: list[float]) -> dict:
    return {"logprobs": types.TensorData.from_torch(torch.tensor(p))}


def test_prompt_positions_padded_with_zero_are_left_out():
    m = logprob_gap_metrics([datum([0.0, 0.0, -1.0, -2.0])], [out([-5.0, -6.0, -1.5, -2.0])])
    assert m["sampler_tokens:sum"] == 2
    assert m["sampler_logprob_diff:mean"] == pytest.approx(0.25) and m["sampler_logprob_diff:max"] == pytest.approx(0.5)
    kl = (math.expm1(-0.5) + 0.5) / 2  # k3 of log-ratio -0.5 and 0.0
    assert m["sampler_mismatch_kl:mean"] == pytest.approx(kl)


def test_provenance_mask_decides_which_positions_count():
    m = logprob_gap_metrics([datum([-1.0, -1.0, -1.0], mask=[0.0, 1.0, 0.0])], [out([-3.0, -1.25, -9.0])])
    assert m["sampler_tokens:sum"] == 1 and m["sampler_logprob_diff:max"] == pytest.approx(0.25)


def test_no_sampler_logprobs_no_metrics_and_no_sampled_token_reports_zeros():
    sft = types.Datum(model_input=types.ModelInput.from_ints([0, 1]), loss_fn_inputs={"target_tokens": [1, 2]})
    assert logprob_gap_metrics([sft], [out([-1.0, -1.0])]) == {}
    m = logprob_gap_metrics([datum([0.0, 0.0])], [out([-1.0, -1.0])])
    assert m == {"sampler_logprob_diff:mean": 0.0, "sampler_logprob_diff:max": 0.0,
                 "sampler_mismatch_kl:mean": 0.0, "sampler_tokens:sum": 0.0}
