"""`stable_reinforce` through the unmodified SDK against `ember serve` (issue 13 item 3):
a `record_stability_info=True` sampler, datums built with `Datum.with_provenance`, the
loss recomputed from returned values, a few training steps, and the user errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tinker
from tinker import types

from helpers.server import MODEL_NAME, OTHER_KEY, sft_datum, stable_datum, stable_reinforce_loss

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

PROMPT = [5, 17, 30, 42, 8]
RTOL = 1e-4  # float32 trainer logprobs vs a float64 recomputation


def params(seed: int, max_tokens: int = 6) -> types.SamplingParams:
    return types.SamplingParams(max_tokens=max_tokens, seed=seed, temperature=1.0, stop=[])


@pytest.fixture(scope="module")
def run(sc):
    """A LoRA run, a recording sampler of its first weights, and two of that sampler's
    sequences; the run then takes one SFT step, so trainer and sampler differ."""
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=3).result()
    tc.forward_backward([sft_datum([5, 17, 30, 42, 8, 61, 9])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    seqs = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params(seed=11)).result().sequences
    tc.forward_backward([sft_datum([5, 17, 30, 42, 8, 3, 9, 12])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return tc, sampler, list(seqs)


def test_loss_equals_documented_formula(run):
    tc, _, seqs = run
    advantages = [1.0, -0.5]
    data = [stable_datum(PROMPT, s, a) for s, a in zip(seqs, advantages)]
    losses = []
    narrow = {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01}
    for config, low, high in ((None, 0.5, 2.0), (narrow, 0.99, 1.01)):
        out = tc.forward(data, "stable_reinforce", config).result()
        expected = stable_reinforce_loss(len(PROMPT), seqs, out.loss_fn_outputs, advantages, low, high)
        assert out.metrics["loss:sum"] == pytest.approx(expected, rel=RTOL, abs=1e-5)
        losses.append(out.metrics["loss:sum"])
    # not a trivial check: the trainer moved away from the sampler (ratios are not all 1)
    # and the narrow band masked tokens the default band kept
    logp = np.concatenate([o["logprobs"].to_numpy()[len(PROMPT) - 1:] for o in out.loss_fn_outputs])
    ratio = np.exp(logp - np.concatenate([s.logprobs for s in seqs]))
    assert np.abs(ratio - 1).max() > 2e-2, ratio
    assert abs(losses[0] - losses[1]) > 1e-3, losses
    fb = tc.forward_backward(data, "stable_reinforce").result()  # with a backward pass: the same value
    assert fb.metrics["loss:sum"] == pytest.approx(losses[0], rel=RTOL, abs=1e-5)


def test_forward_only_uses_the_record_too(run):
    tc, _, seqs = run
    data = [stable_datum(PROMPT, s, 1.0) for s in seqs]
    out = tc.forward(data, "stable_reinforce").result()
    expected = stable_reinforce_loss(len(PROMPT), seqs, out.loss_fn_outputs, [1.0, 1.0])
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=RTOL, abs=1e-5)


def test_loss_decreases_over_a_few_steps(sc):
    """Toy task: make the first sampled completion more likely and the second less."""
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=5).result()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    seqs = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params(seed=4, max_tokens=8)).result().sequences
    assert seqs[0].tokens != seqs[1].tokens
    data = [stable_datum(PROMPT, seqs[0], 1.0), stable_datum(PROMPT, seqs[1], -1.0)]
    losses, seq_logp = [], []
    for _ in range(4):
        out = tc.forward_backward(data, "stable_reinforce").result()
        losses.append(out.metrics["loss:sum"])
        seq_logp.append([float(o["logprobs"].to_numpy()[len(PROMPT) - 1:].sum()) for o in out.loss_fn_outputs])
        tc.optim_step(types.AdamParams(learning_rate=3e-4)).result()
    assert losses[0] == pytest.approx(0.0, abs=1e-3)  # on-policy start: ratios 1, −8·(+1) − 8·(−1)
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < -1.0, losses
    assert seq_logp[-1][0] > seq_logp[0][0] and seq_logp[-1][1] < seq_logp[0][1], seq_logp


def fails_with(tc, data, *words: str) -> str:
    with pytest.raises(tinker.RequestFailedError) as info:
        tc.forward_backward(data, "stable_reinforce").result()
    assert info.value.category == types.RequestErrorCategory.User
    for w in words:
        assert w in info.value.message, info.value.message
    return info.value.message


def _replace_sid(datum: types.Datum, sid: str) -> types.Datum:
    swap = lambda spans: [dataclasses.replace(s, sequence_id=sid) for s in spans]  # noqa: E731
    return dataclasses.replace(datum, model_input_spans=swap(datum.model_input_spans),
                               loss_fn_input_spans=swap(datum.loss_fn_input_spans))


def test_missing_provenance(run):
    tc, _, seqs = run
    plain = dataclasses.replace(stable_datum(PROMPT, seqs[0]), model_input_spans=None, loss_fn_input_spans=None)
    fails_with(tc, [stable_datum(PROMPT, seqs[1]), plain], "datum 1", "needs provenance", "with_provenance")


def test_unknown_sequence_id(run):
    tc, _, seqs = run
    fake = _replace_sid(stable_datum(PROMPT, seqs[0]), seqs[0].sequence_id + "x")
    fails_with(tc, [fake], "datum 0: model_input_spans[0]", "no stability record", repr(seqs[0].sequence_id + "x"))


def test_unrecorded_sample_is_missing(run, sc):
    tc, _, _ = run
    plain_sampler = tc.save_weights_and_get_sampling_client().result()  # record_stability_info=False
    seq = plain_sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params(seed=2)).result().sequences[0]
    fails_with(tc, [stable_datum(PROMPT, seq)], "no stability record", "record_stability_info=True")


def test_another_tenants_sequence_reads_as_missing(run, ember_server):
    tc, _, _ = run
    other = tinker.ServiceClient(base_url=ember_server.base_url, api_key=OTHER_KEY)
    try:
        otc = other.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
        theirs = otc.save_weights_and_get_sampling_client(record_stability_info=True).result()
        seq = theirs.sample(types.ModelInput.from_ints(PROMPT), 1, params(seed=3)).result().sequences[0]
        otc.forward_backward([stable_datum(PROMPT, seq)], "stable_reinforce").result()  # usable by its owner
        msg = fails_with(tc, [stable_datum(PROMPT, seq)], "no stability record", "in this session")
        assert "another" not in msg and "owner" not in msg  # a foreign id reads exactly like an unknown one
    finally:
        other.close("success").result(timeout=30)


def test_another_session_of_the_same_key_is_refused(run, ember_server):
    """Tinker: 'a training request can only name sequences sampled in its own session'."""
    tc, _, seqs = run
    from helpers.server import API_KEY

    second = tinker.ServiceClient(base_url=ember_server.base_url, api_key=API_KEY)
    try:
        tc2 = second.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
        fails_with(tc2, [stable_datum(PROMPT, seqs[0])], "no stability record", "in this session")
    finally:
        second.close("success").result(timeout=30)


def test_tokens_that_differ_from_the_record(run):
    tc, _, seqs = run
    good = stable_datum(PROMPT, seqs[0])
    targets = good.loss_fn_inputs["target_tokens"].to_numpy().copy()
    targets[-1] = (targets[-1] + 1) % 64
    bad = dataclasses.replace(good, loss_fn_inputs={**good.loss_fn_inputs,
                                                    "target_tokens": types.TensorData.from_numpy(targets)})
    fails_with(tc, [good, bad], "datum 1: loss_fn_input_spans[1]", "do not match", f"position {targets.size - 1}")


def test_runs_that_do_not_tile_or_overrun(run):
    tc, _, seqs = run
    s = seqs[0]
    good = stable_datum(PROMPT, s)
    short = dataclasses.replace(good, loss_fn_input_spans=good.loss_fn_input_spans[:1])
    fails_with(tc, [short], "datum 0: loss_fn_input_spans", "cover 4 positions", "has 10")
    n = len(s.tokens)
    over = dataclasses.replace(good, model_input_spans=[
        types.PromptProvenanceSpan(sequence_id=s.sequence_id, length=len(PROMPT) - 1),
        types.SampledProvenanceSpan(sequence_id=s.sequence_id, offset=n - 1, length=n)])
    fails_with(tc, [over], "datum 0: model_input_spans[1]", f"exceeds the {n} recorded sampled tokens")


def test_expired_record_over_http(tiny_model_dir, tmp_path):
    """`--stability.ttl_s` reaches the service; a record idle past it is refused as expired."""
    import time
    from pathlib import Path

    from helpers.server import API_KEY, start_server

    server = start_server(Path(tiny_model_dir), tmp_path, extra_args=["--stability.ttl_s", "3"])
    client = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    try:
        tc = client.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
        sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
        seq = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params(seed=9)).result().sequences[0]
        tc.forward([stable_datum(PROMPT, seq)], "stable_reinforce").result()
        time.sleep(4.0)
        with pytest.raises(tinker.RequestFailedError) as info:
            tc.forward([stable_datum(PROMPT, seq)], "stable_reinforce").result()
        assert info.value.category == types.RequestErrorCategory.User
        assert "datum 0: model_input_spans[0]" in info.value.message and "expired" in info.value.message
        assert "records live 3.0 s after their last use" in info.value.message, info.value.message
    finally:
        client.close("success").result(timeout=30)
        server.stop()
