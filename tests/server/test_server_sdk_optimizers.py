"""Dimuon through the unmodified SDK over HTTP: created with DimuonOptimizerConfig, stepped with
DimuonParams (arriving typed), mismatched params refused as a user error, resumed with its state."""

from __future__ import annotations

import pydantic
import pytest
import tinker
from tinker import types

from helpers.server import MODEL_NAME, sft_datum

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow


def _step(tc, params):
    tc.forward_backward([sft_datum([5, 6, 7, 8, 9, 10]), sft_datum([11, 12, 13, 14])], "cross_entropy").result()
    return tc.optim_step(params).result()


def test_dimuon_run_over_http(sc):
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, optimizer=types.DimuonOptimizerConfig()).result()
    out = _step(tc, types.DimuonParams(learning_rate=1e-2, grad_clip_norm=1.0))
    assert out.metrics["step:max"] == 1.0
    with pytest.raises(tinker.RequestFailedError, match="AdamParams.*dimuon.*DimuonParams") as exc:
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert exc.value.category.name == "User"
    path = tc.save_state("dimuon").result().path
    resumed = sc.create_training_client_from_state_with_optimizer(path).result()
    a = _step(tc, types.DimuonParams(learning_rate=1e-2))
    b = _step(resumed, types.DimuonParams(learning_rate=1e-2))
    assert a.metrics == b.metrics


def test_adamw_run_refuses_dimuon_params(sc):
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    with pytest.raises(tinker.RequestFailedError, match="DimuonParams.*adamw.*AdamParams") as exc:
        tc.optim_step(types.DimuonParams(learning_rate=1e-2)).result()
    assert exc.value.category.name == "User"


def test_weights_only_resume_takes_the_requested_optimizer(sc):
    """create_training_client_from_state(optimizer=...) starts that optimizer fresh (the SDK's
    default is Adam); with optimizer state the checkpoint's optimizer is kept."""
    adam = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    _step(adam, types.AdamParams(learning_rate=1e-2))
    path = adam.save_state("adam").result().path
    switched = sc.create_training_client_from_state(path, optimizer=types.DimuonOptimizerConfig()).result()
    assert _step(switched, types.DimuonParams(learning_rate=1e-2)).metrics["step:max"] == 1.0
    with pytest.raises(tinker.RequestFailedError, match="AdamParams.*dimuon"):
        switched.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    plain = sc.create_training_client_from_state(path).result()
    assert _step(plain, types.AdamParams(learning_rate=1e-2)).metrics["step:max"] == 1.0
    kept = sc.create_training_client_from_state_with_optimizer(path).result()
    assert _step(kept, types.AdamParams(learning_rate=1e-2)).metrics["step:max"] == 2.0


def _parse_optim(params: dict):
    from ember.server import requests as rq

    data = {"model_id": "m", "seq_id": 1, "optimizer_params": params, "type": "optim_step"}
    return rq.optim_params(data, rq.parse(rq.OptimStepRequest, data))


def test_newer_sdk_dimuon_fields_are_kept_and_hostile_ones_refused():
    from ember.server.errors import BadRequest

    got = _parse_optim({"type": "dimuon", "learning_rate": 1e-3, "damping": 0.3, "rank_lr_correction_exponent": 0})
    assert isinstance(got, types.DimuonParams) and got.damping == 0.3 and got.rank_lr_correction_exponent == 0
    assert _parse_optim({"type": "dimuon", "learning_rate": 1e-3}).damping is None  # SDK 0.38: ember's default
    with pytest.raises(pydantic.ValidationError):
        _parse_optim({"type": "dimuon", "learning_rate": 1e-3, "damping": "lots"})
    with pytest.raises(BadRequest, match="unknown optimizer 'sgd'"):
        _parse_optim({"type": "sgd", "learning_rate": 1e-3})
