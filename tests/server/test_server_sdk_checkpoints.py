"""docs/protocol.md §9 checkpoint items 28-32 with the unmodified official SDK."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from helpers.server import API_KEY, MODEL_NAME, OTHER_KEY, sft_datum

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

DATA = [sft_datum([4, 8, 15, 16, 23, 42]), sft_datum([7, 14, 21, 28])]
ADAM = types.AdamParams(learning_rate=3e-2)


def fwd(tc) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy().copy() for o in tc.forward(DATA, "cross_entropy").result().loss_fn_outputs]


def train_step(tc) -> None:
    tc.forward_backward(DATA, "cross_entropy").result()
    tc.optim_step(ADAM).result()


@pytest.fixture(scope="module")
def saved(sc):
    return save_c1(sc)


def save_c1(sc):
    """A run after two steps, saved as "c1" (weights + Adam state); then one more step."""
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=3, seed=4).result()
    train_step(tc)
    train_step(tc)
    at_save = fwd(tc)
    path = tc.save_state("c1").result().path
    train_step(tc)
    return tc, path, at_save, fwd(tc)


def test_save_state_path_and_resume_with_optimizer_in_a_new_client(ember_server, saved):
    tc, path, at_save, after_next_step = saved
    assert path == f"tinker://{tc.get_info().model_id}/weights/c1"
    fresh = tinker.ServiceClient(base_url=ember_server.base_url, api_key=API_KEY)
    try:
        mark = ember_server.log_mark()
        resumed = fresh.create_training_client_from_state_with_optimizer(path).result()
        load = ember_server.requests_since(mark, "/load_weights")[0]["json"]
        assert (load["model_seq_id"], load["optimizer"], load["path"]) == (0, True, path)
        assert "model_id" not in load and "seq_id" not in load
        info = resumed.get_info()
        assert info.model_id == f"{load['session_id']}:train:0" and info.lora_rank == 3
        for a, b in zip(fwd(resumed), at_save, strict=True):
            np.testing.assert_array_equal(a, b)
        train_step(resumed)  # Adam moments restored: the same step as on the original run
        for a, b in zip(fwd(resumed), after_next_step, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    finally:
        fresh.close("success").result(timeout=30)


def test_resume_without_optimizer_resets_adam(sc, saved):
    _, path, at_save, after_next_step = saved
    resumed = sc.create_training_client_from_state(path).result()
    for a, b in zip(fwd(resumed), at_save, strict=True):
        np.testing.assert_array_equal(a, b)
    train_step(resumed)
    assert np.abs(fwd(resumed)[0] - after_next_step[0]).max() > 1e-5  # fresh Adam: a different step


def test_deprecated_load_state_into_a_fresh_client(ember_server, sc, saved):
    _, path, at_save, _ = saved
    for method in ("load_state", "load_state_with_optimizer"):
        tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=3, seed=99).result()
        mark = ember_server.log_mark()
        with pytest.warns(FutureWarning, match="DEPRECATED"):
            getattr(tc, method)(path).result()
        sent = ember_server.requests_since(mark, "/load_weights")[0]["json"]
        assert (sent["model_id"], sent["seq_id"], sent["optimizer"]) == (
            tc.get_info().model_id, 1, method.endswith("optimizer"))
        for a, b in zip(fwd(tc), at_save, strict=True):
            np.testing.assert_array_equal(a, b)


def test_duplicate_checkpoint_name_is_a_user_failure_not_a_409_loop(ember_server, sc):
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
    tc.save_state("dup").result()
    mark = ember_server.log_mark()
    with pytest.raises(tinker.RequestFailedError) as info:
        tc.save_state("dup").result()
    assert info.value.category == types.RequestErrorCategory.User
    assert [e["status"] for e in ember_server.requests_since(mark, "/save_weights")] == [200]
    overwritten = tc.save_state("dup", overwrite=True).result()
    assert overwritten.path.endswith("/weights/dup")
    with pytest.raises(tinker.RequestFailedError) as bad:
        tc.save_state("../escape").result()
    assert bad.value.category == types.RequestErrorCategory.User


def test_rest_client_endpoints(served):
    """On SQLite and PostgreSQL: listings, pagination, deletion and owners over REST."""
    sc = tinker.ServiceClient(base_url=served.base_url, api_key=API_KEY)
    try:
        sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()  # a second run to page through
        _rest_client_endpoints(served, save_c1(sc))
    finally:
        sc.close("success").result(timeout=30)


def _rest_client_endpoints(ember_server, saved):
    tc, path, _, _ = saved
    run_id = tc.get_info().model_id
    sampler_path = tc.save_weights_for_sampler("s1").result().path
    rc = tinker.RestClient(base_url=ember_server.base_url, api_key=API_KEY)
    ckpts = rc.list_checkpoints(run_id).result().checkpoints
    assert {c.tinker_path for c in ckpts} >= {path, sampler_path}
    assert {c.checkpoint_type for c in ckpts} >= {"training", "sampler"}
    run = rc.get_training_run(run_id).result()
    assert (run.training_run_id, run.base_model, run.is_lora, run.lora_rank) == (run_id, MODEL_NAME, True, 3)
    assert rc.get_training_run_by_tinker_path(path).result().training_run_id == run_id
    total = rc.list_training_runs(limit=1000).result().cursor.total_count
    assert total >= 2
    first, second = rc.list_training_runs(limit=1, offset=0).result(), rc.list_training_runs(limit=1, offset=1).result()
    assert first.cursor.limit == 1 and first.cursor.total_count == total and second.cursor.offset == 1
    assert first.training_runs[0].training_run_id != second.training_runs[0].training_run_id
    info = rc.get_weights_info_by_tinker_path(path).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == (MODEL_NAME, True, 3)
    assert MODEL_NAME in [m.model_name for m in rc.get_server_capabilities().result().supported_models]
    mine = {c.tinker_path for c in rc.list_user_checkpoints().result().checkpoints}
    assert {path, sampler_path} <= mine
    rc.delete_checkpoint_from_tinker_path(sampler_path).result()
    assert sampler_path not in {c.tinker_path for c in rc.list_checkpoints(run_id).result().checkpoints}
    other = tinker.RestClient(base_url=ember_server.base_url, api_key=OTHER_KEY)
    assert path not in {c.tinker_path for c in other.list_user_checkpoints().result().checkpoints}
    with pytest.raises(tinker.NotFoundError):
        other.get_weights_info_by_tinker_path(path).result()


def test_other_tenant_cannot_load_my_checkpoint(ember_server, saved):
    _, path, _, _ = saved
    other = tinker.ServiceClient(base_url=ember_server.base_url, api_key=OTHER_KEY)
    try:
        with pytest.raises(tinker.RequestFailedError) as info:
            other.create_training_client_from_state(path).result()
        assert info.value.category == types.RequestErrorCategory.User
    finally:
        other.close("success").result(timeout=30)


def test_a_checkpoint_saved_before_the_first_optim_step_loads_with_optimizer(ember_server, sc):
    """save_state before any optim_step, then both ways of loading it with the optimizer
    (this once failed with category server: no Adam moments to load)."""
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=3, seed=9).result()
    at_save = fwd(tc)
    path = tc.save_state("before-any-step").result().path
    train_step(tc)
    after_step = fwd(tc)
    tc.load_state_with_optimizer(path).result()
    for a, b in zip(fwd(tc), at_save, strict=True):
        np.testing.assert_array_equal(a, b)
    fresh = tinker.ServiceClient(base_url=ember_server.base_url, api_key=API_KEY)
    try:
        resumed = fresh.create_training_client_from_state_with_optimizer(path).result()
        for a, b in zip(fwd(resumed), at_save, strict=True):
            np.testing.assert_array_equal(a, b)
        train_step(resumed)  # a fresh Adam, as the original had: the same first step
        for a, b in zip(fwd(resumed), after_step, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    finally:
        fresh.close("success").result(timeout=30)
