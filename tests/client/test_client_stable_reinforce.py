"""`stable_reinforce` through the in-process `ember.ServiceClient`: the same recording,
resolution, formula and refusals as over HTTP (tests/server/test_server_sdk_stable_reinforce.py)."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

import ember
from helpers.clock import ManualClock
from helpers.server import sft_datum, stable_datum, stable_reinforce_loss
from ember.service import Service
from ember.service.config import ServiceConfig

MODEL = "ember-test/tiny-qwen3"
PROMPT = [5, 17, 30, 42, 8]


def params(seed: int) -> types.SamplingParams:
    return types.SamplingParams(max_tokens=6, seed=seed, temperature=1.0, stop=[])


@pytest.fixture
def clock():
    return ManualClock()


@pytest.fixture
def client(tmp_path, tiny_model_dir, clock):
    config = ServiceConfig(data_dir=tmp_path / "data", models={MODEL: str(tiny_model_dir)},
                           stability={"ttl_s": 4.0})
    service = Service(config, clock=clock)  # the records' sliding expiry runs on the test's clock
    sc = ember.ServiceClient(service=service)
    yield sc
    sc.close("success")
    service.close()


@pytest.mark.slow
def test_in_process_end_to_end_and_refusals(client, clock):
    tc = client.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    seqs = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params(11)).result().sequences
    tc.forward_backward([sft_datum([5, 17, 30, 42, 8, 61, 9])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()  # trainer now differs from the sampler
    adv = [1.0, -0.5]
    out = tc.forward_backward([stable_datum(PROMPT, s, a) for s, a in zip(seqs, adv)], "stable_reinforce").result()
    expected = stable_reinforce_loss(len(PROMPT), seqs, out.loss_fn_outputs, adv)
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    logp = out.loss_fn_outputs[0]["logprobs"].to_numpy()[len(PROMPT) - 1:]
    assert np.abs(np.exp(logp - np.asarray(seqs[0].logprobs)) - 1).max() > 2e-2  # off-policy: not trivial

    # a sampler without the flag records nothing
    plain = tc.save_weights_and_get_sampling_client().result()
    unrecorded = plain.sample(types.ModelInput.from_ints(PROMPT), 1, params(2)).result().sequences[0]
    with pytest.raises(tinker.RequestFailedError) as info:
        tc.forward_backward([stable_datum(PROMPT, unrecorded)], "stable_reinforce").result()
    assert info.value.category == types.RequestErrorCategory.User
    assert "datum 0: model_input_spans[0]" in str(info.value) and "no stability record" in str(info.value)

    # sliding expiry (ttl 4 s here; Tinker's is a day): each use restarts it, 5 s idle ends it
    for _ in range(2):
        clock.advance(2.0)
        tc.forward([stable_datum(PROMPT, seqs[0])], "stable_reinforce").result()
    clock.advance(5.0)
    with pytest.raises(tinker.RequestFailedError) as info:
        tc.forward([stable_datum(PROMPT, seqs[0])], "stable_reinforce").result()
    assert "expired" in str(info.value) and "datum 0: model_input_spans[0]" in str(info.value)


@pytest.mark.parametrize("owner", ["local", "someone-else"], ids=["same-owner-other-session", "other-tenant"])
def test_another_session_or_tenant_cannot_name_the_sequence(client, owner):
    tc = client.create_lora_training_client(base_model=MODEL, rank=4).result()
    sampler = client.create_sampling_client(base_model=MODEL, record_stability_info=True).result()
    seq = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params(5)).result().sequences[0]
    tc.forward([stable_datum(PROMPT, seq)], "stable_reinforce").result()  # its own session: fine
    second = ember.ServiceClient(service=client.service, owner=owner if owner != "local" else client.owner)
    try:
        tc2 = second.create_lora_training_client(base_model=MODEL, rank=4).result()
        with pytest.raises(tinker.RequestFailedError) as info:
            tc2.forward([stable_datum(PROMPT, seq)], "stable_reinforce").result()
        assert "no stability record" in str(info.value) and "in this session" in str(info.value)
    finally:
        second.close("success")


def test_finishing_a_session_drops_its_records(client):
    service = client.service
    mine = client.create_sampling_client(base_model=MODEL, record_stability_info=True).result()
    mine.sample(types.ModelInput.from_ints(PROMPT), 2, params(1)).result()
    second = ember.ServiceClient(service=service)
    theirs = second.create_sampling_client(base_model=MODEL, record_stability_info=True).result()
    theirs.sample(types.ModelInput.from_ints(PROMPT), 3, params(2)).result()
    assert len(service.records) == 5
    second.close("success")
    assert len(service.records) == 2


def test_the_cookbook_rl_loop_datum_is_accepted(client):
    """tinker-cookbook 0.6.1's rl_loop builds targets ``[0] * ob_len + sampled_tokens`` with
    a prompt run over the zeros (its own `with_sampled_provenance`): the placeholders are
    accepted and the loss equals that of the datum with the true prompt tokens."""
    rl_loop = pytest.importorskip("tinker_cookbook.recipes.rl_loop",
                                  reason="tinker-cookbook is not installed (make test installs it)")
    tc = client.create_lora_training_client(base_model=MODEL, rank=4).result()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    seq = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params(7)).result().sequences[0]
    ob_len = len(PROMPT) - 1
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT + list(seq.tokens[:-1])),
        loss_fn_inputs={"target_tokens": [0] * ob_len + list(seq.tokens),
                        "advantages": [0.0] * ob_len + [1.0] * len(seq.tokens)})
    cookbook = rl_loop.with_sampled_provenance(datum, len(PROMPT), len(seq.tokens), seq.sequence_id)
    got, want = (tc.forward([d], "stable_reinforce").result() for d in (cookbook, stable_datum(PROMPT, seq)))
    assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-6)
    wrong = list(seq.tokens)
    wrong[0] = (wrong[0] + 1) % 50
    bad = types.Datum(model_input=datum.model_input,
                      loss_fn_inputs={**datum.loss_fn_inputs, "target_tokens": [0] * ob_len + wrong})
    with pytest.raises(tinker.RequestFailedError) as info:
        tc.forward([rl_loop.with_sampled_provenance(bad, len(PROMPT), len(wrong), seq.sequence_id)],
                   "stable_reinforce").result()
    assert "datum 0: loss_fn_input_spans[1]" in str(info.value) and "recorded sampled token 0" in str(info.value)
