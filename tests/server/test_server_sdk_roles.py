"""A value-head critic through the unmodified official SDK against `ember serve` (issue 14):
created with `user_metadata={"ember.head": "value"}`, its values read with `forward`, trained
with `forward_backward_custom` (the SDK's own client-side loss path, no change to it) and with
the built-in value losses named as strings."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from helpers.server import MODEL_NAME

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

VALUE = {"ember.head": "value"}
SEQS = [[5, 9, 14, 22, 31, 40, 7], [3, 8, 13, 2], [40, 41, 42, 43, 44]]
TARGET = 1.5  # every position's target value


def floats(xs) -> types.TensorData:
    """A float input the SDK's Datum does not know by name (it converts lists by key)."""
    return types.TensorData(data=[float(x) for x in xs], dtype="float32", shape=[len(xs)])


def value_datum(tokens, returns=None, old_values=None) -> types.Datum:
    inputs: dict = {"target_tokens": list(tokens)}
    if returns is not None:
        inputs["returns"] = floats(returns)
    if old_values is not None:
        inputs["old_values"] = floats(old_values)
    return types.Datum(model_input=types.ModelInput.from_ints(list(tokens)), loss_fn_inputs=inputs)


def new_critic(sc, seed: int = 0):
    return sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=seed, user_metadata=VALUE).result()


def forward_values(tc, seqs=SEQS) -> list[np.ndarray]:
    out = tc.forward([value_datum(s) for s in seqs], "cross_entropy").result()
    return [np.asarray(o["logprobs"].data, dtype=np.float64) for o in out.loss_fn_outputs]


def error(tc) -> float:
    return float(np.mean([np.mean((v - TARGET) ** 2) for v in forward_values(tc)]))


def mse_to_target(data, outputs):
    loss = sum(((v - TARGET) ** 2).mean() for v in outputs) / len(outputs)
    return loss, {"mse": float(loss.detach())}


def test_sdk_critic_forward_gives_one_value_per_position_and_custom_training_lowers_its_error(sc):
    tc = new_critic(sc)
    vals = forward_values(tc)
    assert [len(v) for v in vals] == [len(s) for s in SEQS]
    assert all(np.isfinite(v).all() for v in vals) and np.std(np.concatenate(vals)) > 0
    assert tc.get_info().model_data is not None
    start = error(tc)
    for _ in range(12):
        out = tc.forward_backward_custom([value_datum(s) for s in SEQS], mse_to_target).result()
        assert np.isfinite(out.metrics["mse"])
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    assert error(tc) < 0.5 * start, (start, error(tc))


def test_sdk_builtin_value_losses_equal_their_formulas(sc):
    tc = new_critic(sc, seed=2)
    vals = forward_values(tc)
    returns = [v + np.linspace(-1.0, 1.0, len(v)) for v in vals]
    old = [v + 0.3 for v in vals]
    data = [value_datum(s, r, o) for s, r, o in zip(SEQS, returns, old)]
    mse = tc.forward([value_datum(s, r) for s, r in zip(SEQS, returns)], "value_mse").result().metrics["loss:sum"]  # type: ignore[arg-type]
    assert mse == pytest.approx(sum(0.5 * ((v - r) ** 2).sum() for v, r in zip(vals, returns)), rel=1e-5)
    eps = 0.1
    clipped = tc.forward(data, "ppo_value", {"value_clip": eps}).result().metrics["loss:sum"]  # type: ignore[arg-type]
    expected = 0.0
    for v, r, o in zip(vals, returns, old):
        vc = o + np.clip(v - o, -eps, eps)
        expected += 0.5 * np.maximum((v - r) ** 2, (vc - r) ** 2).sum()
    assert clipped == pytest.approx(expected, rel=1e-5)
    out = tc.forward_backward(data, "ppo_value", {"value_clip": eps}).result()  # type: ignore[arg-type]
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert not np.allclose(np.concatenate(forward_values(tc)), np.concatenate(vals))


def test_sdk_critic_has_no_sampler_and_a_policy_loss_is_a_user_error(sc):
    tc = new_critic(sc, seed=4)
    with pytest.raises(tinker.RequestFailedError, match="no sampler") as info:
        tc.save_weights_and_get_sampling_client().result()
    assert info.value.category == types.RequestErrorCategory.User
    bad = types.Datum(model_input=types.ModelInput.from_ints(SEQS[0]),
                      loss_fn_inputs={"target_tokens": SEQS[0], "logprobs": [-1.0] * 7, "advantages": [1.0] * 7})
    with pytest.raises(tinker.RequestFailedError, match="value head") as info:
        tc.forward_backward([bad], "importance_sampling").result()
    assert info.value.category == types.RequestErrorCategory.User
    assert len(forward_values(tc)) == len(SEQS)  # the run keeps working


@pytest.mark.parametrize("meta", [{"ember.head": "critic"}, {"ember.head": ""}])
def test_sdk_bad_head_metadata_fails_the_create_naming_the_key(sc, meta):
    with pytest.raises(Exception, match=r"ember\.head") as info:
        sc.create_lora_training_client(base_model=MODEL_NAME, rank=2, user_metadata=meta).result()
    assert "policy" in str(info.value) and "value" in str(info.value)


def test_sdk_critic_state_round_trip(sc):
    tc = new_critic(sc, seed=6)
    tc.forward_backward([value_datum(SEQS[0], [1.0] * 7)], "value_mse").result()  # type: ignore[arg-type]
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("critic").result().path
    restored = sc.create_training_client_from_state(path).result()
    for a, b in zip(forward_values(tc), forward_values(restored)):
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=0, atol=0)


@pytest.mark.parametrize("head", [5, ["value"], "v" * 100_000], ids=["int", "list", "huge"])
def test_raw_http_hostile_head_values_are_user_errors_with_short_messages(ember_server, head):
    import httpx

    from helpers.server import API_KEY

    with httpx.Client(base_url=ember_server.base_url + "/api/v1", headers={"X-API-Key": API_KEY}, timeout=60) as http:
        session = http.post("/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "x"}).json()
        r = http.post("/create_model", json={"session_id": session["session_id"], "model_seq_id": 0,
                                             "base_model": MODEL_NAME, "lora_config": {"rank": 2},
                                             "user_metadata": {"ember.head": head}})
        if r.status_code == 200:  # accepted as a request: the create future fails as a user error
            for _ in range(50):
                body = http.post("/retrieve_future", json={"request_id": r.json()["request_id"]},
                                 headers={"Accept": "application/json"}).json()
                if body.get("type") != "try_again":
                    break
        else:
            assert r.status_code in (400, 422), r.text
            body = r.json()
        text = str(body.get("error") or body.get("detail"))
        assert body.get("category", "user") == "user" and ("ember.head" in text or "user_metadata" in text) or r.status_code == 422, body
        assert len(text) < 2000, len(text)
