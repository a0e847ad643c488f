"""ember.ServiceClient in process: an SDK-style SFT script, accumulation, custom loss, errors."""

from __future__ import annotations

import pytest
import tinker
import torch
from tinker import types

from helpers.datums import random_sft_datums, sft_datum

BASE = "ember-test/tiny-qwen3"
VOCAB = 84
PROBE = [5, 9, 14, 22, 31, 40, 7]
ADAM = types.AdamParams(learning_rate=2e-2)


def _probe_logprobs(tc) -> torch.Tensor:
    return tc.forward([sft_datum(PROBE)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()


def sdk_sft_script(service_client, steps: int = 5) -> dict:
    """Written against the official SDK's API only (as for tinker.ServiceClient(base_url=...))."""
    training_client = service_client.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    tokenizer = training_client.get_tokenizer()
    tokens = tokenizer.encode("hello world, hello tinker")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    losses = []
    for _ in range(steps):
        fwd_bwd = training_client.forward_backward([datum], "cross_entropy")
        optim = training_client.optim_step(types.AdamParams(learning_rate=3e-3))
        losses.append(fwd_bwd.result().metrics["loss:sum"])
        optim.result()
    sampling_client = training_client.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokens[:5])
    sample = sampling_client.sample(prompt, num_samples=3, sampling_params=types.SamplingParams(max_tokens=4, seed=7)).result()
    logprobs = sampling_client.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    trainer = training_client.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    return {"losses": losses, "sample": sample, "sampler_logprobs": logprobs, "trainer_logprobs": trainer}


def test_sdk_style_sft_script_runs_in_process(make_client):
    out = sdk_sft_script(make_client())
    losses = out["losses"]
    assert losses[-1] < 0.8 * losses[0] and losses == sorted(losses, reverse=True), losses
    seqs = out["sample"].sequences
    assert len(seqs) == 3 and len({s.sequence_id for s in seqs}) == 3
    assert all(len(s.tokens) == len(s.logprobs) and s.stop_reason in ("stop", "length") for s in seqs)
    # Contract 5 through the clients: sampler prompt logprobs == trainer forward logprobs.
    assert out["sampler_logprobs"][0] is None
    torch.testing.assert_close(torch.tensor(out["sampler_logprobs"][1:]), torch.tensor(out["trainer_logprobs"]),
                               rtol=0, atol=1e-4)


def test_gradient_accumulation_equals_one_big_batch(make_client):
    sc = make_client()
    a, b = random_sft_datums(3, VOCAB, seed=1), random_sft_datums(2, VOCAB, seed=2)
    split = sc.create_lora_training_client(BASE, rank=4, seed=5).result()
    whole = sc.create_lora_training_client(BASE, rank=4, seed=5).result()
    la = split.forward_backward(a, "cross_entropy")
    lb = split.forward_backward(b, "cross_entropy")
    split.optim_step(ADAM).result()
    lab = whole.forward_backward(a + b, "cross_entropy")
    whole.optim_step(ADAM).result()
    total = la.result().metrics["loss:sum"] + lb.result().metrics["loss:sum"]
    assert lab.result().metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    after_split, after_whole = _probe_logprobs(split), _probe_logprobs(whole)
    torch.testing.assert_close(after_split, after_whole, rtol=1e-5, atol=1e-6)


def test_forward_does_not_train_and_forward_backward_custom_matches_cross_entropy(make_client):
    sc = make_client()
    data = random_sft_datums(3, VOCAB, seed=3)
    custom = sc.create_lora_training_client(BASE, rank=4, seed=9).result()
    plain = sc.create_lora_training_client(BASE, rank=4, seed=9).result()
    before = _probe_logprobs(custom)
    custom.forward(data, "cross_entropy").result()
    custom.optim_step(ADAM).result()  # no gradient accumulated: nothing changes
    torch.testing.assert_close(_probe_logprobs(custom), before, rtol=0, atol=0)

    def ce(batch, logprobs_list):
        loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(batch, logprobs_list))
        return loss, {"ce:sum": float(loss)}

    fut = custom.forward_backward_custom(data, ce)
    step = custom.optim_step(ADAM)  # submitted before the custom backward exists: must wait for it
    res = fut.result()
    assert step.result().metrics["grad_norm:mean"] > 0
    ref = plain.forward_backward(data, "cross_entropy").result()
    plain.optim_step(ADAM).result()
    assert res.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-5)
    assert res.metrics["surrogate_loss:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-5)
    assert res.metrics["ce:sum"] == pytest.approx(res.metrics["loss:sum"])
    torch.testing.assert_close(_probe_logprobs(custom), _probe_logprobs(plain), rtol=1e-5, atol=1e-6)


def test_failures_raise_request_failed_error_and_the_client_keeps_working(make_client):
    sc = make_client()
    tc = sc.create_lora_training_client(BASE, rank=4).result()
    data = random_sft_datums(2, VOCAB, seed=4)
    with pytest.raises(tinker.RequestFailedError) as err:
        tc.forward_backward(data, "no_such_loss").result()
    assert err.value.category == types.RequestErrorCategory.User
    with pytest.raises(tinker.RequestFailedError) as err:
        tc.forward_backward([sft_datum([1, 2, 500, 3])], "cross_entropy").result()
    assert err.value.category == types.RequestErrorCategory.User and "datum 0" in err.value.message
    assert tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"] > 0
    assert tc.optim_step(ADAM).result().metrics["step:max"] == 1.0
    with pytest.raises(tinker.RequestFailedError) as err:
        sc.create_lora_training_client("no/such-model", rank=4).result()
    assert err.value.category == types.RequestErrorCategory.User
    with pytest.raises(ValueError):
        tc.forward_backward([], "cross_entropy")


def test_futures_are_awaitable_and_the_creation_future_works_as_a_client(make_client):
    import asyncio

    sc = make_client()
    data = random_sft_datums(2, VOCAB, seed=6)

    async def main():
        tc = await sc.create_lora_training_client(BASE, rank=4)
        fb = tc.forward_backward(data, "cross_entropy")
        step = tc.optim_step(ADAM)
        return (await fb).metrics["loss:sum"], (await step).metrics["step:max"], await tc.forward_backward_async(data, "cross_entropy")

    loss, step, fut = asyncio.run(main())
    assert loss > 0 and step == 1.0 and fut.result(timeout=60).metrics["loss:sum"] > 0
    # Older SDK code used the creation future as the client directly (deprecated, still works).
    legacy = sc.create_lora_training_client(BASE, rank=4)
    with pytest.warns(FutureWarning):
        out = legacy.forward_backward(data, "cross_entropy").result()
    assert out.metrics["loss:sum"] == pytest.approx(loss, rel=1e-6)  # fresh adapter: same loss as above
