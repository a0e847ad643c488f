"""Value-head runs in process (issue 14): a critic or reward model is a training run whose
`user_metadata["ember.head"]` is "value". Its per-token outputs (values) come back where a
policy's log-probs do, it trains with the value losses or `forward_backward_custom`, it
saves, restores and exports with its head, and it has no sampler."""

from __future__ import annotations

import pytest
import torch
from tinker import types
from tinker.cli.commands.checkpoint import _download_external_weights

from helpers.datums import sft_datum

BASE = "ember-test/tiny-qwen3"
VALUE = {"ember.head": "value"}
TOKENS = [5, 9, 14, 22, 31, 40, 7]
RETURNS = [0.5, -1.0, 2.0, 0.0, 1.5, -0.5, 1.0]


def floats(xs) -> types.TensorData:
    """A float input the SDK's Datum does not know by name (it converts lists by key)."""
    return types.TensorData(data=[float(x) for x in xs], dtype="float32", shape=[len(xs)])


def value_datum(tokens=TOKENS, returns=None, old_values=None, weights=None) -> types.Datum:
    inputs: dict = {"target_tokens": list(tokens)}  # read by the SDK's custom-loss path, ignored by the head
    for key, val in (("returns", returns), ("old_values", old_values), ("weights", weights)):
        if val is not None:
            inputs[key] = floats(val)
    return types.Datum(model_input=types.ModelInput.from_ints(list(tokens)), loss_fn_inputs=inputs)


def values(tc, tokens=TOKENS) -> torch.Tensor:
    out = tc.forward([value_datum(tokens)], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_torch()


def critic(sc, lora: bool = True, seed: int = 0):
    if lora:
        return sc.create_lora_training_client(BASE, rank=4, seed=seed, user_metadata=VALUE).result()
    return sc.create_full_training_client(BASE, user_metadata=VALUE).result()


def value_step(tc, lr: float = 1e-2):
    out = tc.forward_backward([value_datum(returns=RETURNS)], "value_mse").result()
    tc.optim_step(types.AdamParams(learning_rate=lr)).result()
    return out


def mse_loss(data, outputs):
    loss = sum(0.5 * ((v - torch.tensor(d.loss_fn_inputs["returns"].data)) ** 2).sum()
               for d, v in zip(data, outputs))
    return loss, {}


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_values_match_the_exported_token_classification_model(make_client, tmp_path, tiny_model_dir, lora):
    from peft import PeftModel
    from transformers import AutoModelForTokenClassification

    sc = make_client()
    tc = critic(sc, lora)
    value_step(tc)
    got = values(tc)
    assert got.shape == (len(TOKENS),) and torch.isfinite(got).all()
    path = tc.save_weights_external("critic").result().path
    target = tmp_path / "dl"
    target.mkdir()
    assert _download_external_weights(sc.create_rest_client(), path, target, show_progress=False, format="json") > 0
    if lora:
        base = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, target)
    else:
        model = AutoModelForTokenClassification.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        direct = model.eval()(input_ids=torch.tensor([TOKENS])).logits[0, :, 0]
    torch.testing.assert_close(direct, got, rtol=1e-5, atol=1e-5)


def test_builtin_value_mse_and_the_custom_loss_take_the_same_step(make_client):
    sc = make_client()
    a, b = critic(sc, seed=7), critic(sc, seed=7)
    torch.testing.assert_close(values(a), values(b), rtol=0, atol=0)
    builtin = a.forward_backward([value_datum(returns=RETURNS)], "value_mse").result()
    custom = b.forward_backward_custom([value_datum(returns=RETURNS)], mse_loss).result()
    assert builtin.metrics["loss:sum"] == pytest.approx(custom.metrics["loss:sum"], rel=1e-5)
    for tc in (a, b):
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    torch.testing.assert_close(values(a), values(b), rtol=1e-5, atol=1e-6)


def test_a_bad_head_name_fails_the_create_naming_the_key(make_client):
    sc = make_client()
    with pytest.raises(Exception, match=r"ember\.head.*(policy|value)") as info:
        sc.create_lora_training_client(BASE, rank=2, user_metadata={"ember.head": "critic"}).result()
    assert "critic" in str(info.value)
    assert critic(sc).model_id  # the service keeps working


def test_a_value_run_has_no_sampler_and_keeps_working(make_client):
    sc = make_client()
    tc = critic(sc)
    with pytest.raises(Exception, match="no sampler"):
        tc.save_weights_for_sampler("s").result()
    with pytest.raises(Exception, match="no sampler"):
        tc.save_weights_and_get_sampling_client().result()
    assert value_step(tc).metrics["loss:sum"] > 0
    assert not [c for c in sc.create_rest_client().list_checkpoints(tc.model_id).result().checkpoints]


def test_a_policy_loss_on_a_value_run_is_refused_and_nothing_is_accumulated(make_client):
    sc = make_client()
    a, b = critic(sc, seed=3), critic(sc, seed=3)
    bad = types.Datum(model_input=types.ModelInput.from_ints(TOKENS),
                      loss_fn_inputs={"target_tokens": TOKENS, "logprobs": [-1.0] * 7, "advantages": [1.0] * 7})
    with pytest.raises(Exception, match="value head"):
        a.forward_backward([bad], "ppo").result()
    value_step(a)
    value_step(b)
    torch.testing.assert_close(values(a), values(b), rtol=0, atol=0)


def test_state_round_trip_restores_the_head_and_the_next_step(make_client):
    sc = make_client()
    tc = critic(sc, seed=1)
    value_step(tc)
    path = tc.save_state("s").result().path
    restored = sc.create_training_client_from_state_with_optimizer(path).result()
    torch.testing.assert_close(values(restored), values(tc), rtol=0, atol=0)
    value_step(tc)
    value_step(restored)
    torch.testing.assert_close(values(restored), values(tc), rtol=0, atol=0)
    with pytest.raises(Exception, match=r"ember\.head.*'value'"):
        sc.create_training_client_from_state(path, user_metadata={"ember.head": "policy"}).result()
    policy = sc.create_lora_training_client(BASE, rank=4, seed=1).result()
    with pytest.raises(Exception, match="value"):
        policy.load_state(path).result()


def test_a_lora_policy_and_a_lora_critic_share_one_base(make_client):
    sc = make_client()
    policy = sc.create_lora_training_client(BASE, rank=4, seed=0).result()
    datum = sft_datum(TOKENS)

    def logprobs():
        return policy.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()

    before = logprobs()
    tc = critic(sc)
    value_step(tc)
    torch.testing.assert_close(logprobs(), before, rtol=0, atol=0)
    policy.forward_backward([datum], "cross_entropy").result()
    policy.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert policy.save_weights_and_get_sampling_client().result().sample(
        types.ModelInput.from_ints(TOKENS[:3]), 1, types.SamplingParams(max_tokens=2)).result().sequences


def test_a_critic_on_a_worker_group_matches_the_local_one(make_client, tmp_path):
    grouped = make_client(tmp_path / "group", workers={"runtime": "inline"})
    local = make_client(tmp_path / "local")
    runs = [critic(sc, seed=9) for sc in (grouped, local)]
    torch.testing.assert_close(values(runs[0]), values(runs[1]), rtol=1e-5, atol=1e-6)
    losses = [value_step(tc).metrics["loss:sum"] for tc in runs]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    torch.testing.assert_close(values(runs[0]), values(runs[1]), rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="no sampler"):
        runs[0].save_weights_and_get_sampling_client().result()
