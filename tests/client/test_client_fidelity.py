"""forward_backward's sampler/trainer log-prob gap (ember.service.fidelity) through the
in-process client: numerics alone for the weights the sampler had (contract 5: fp32 CPU
1e-4), and a gap that grows once training moves past them."""

from __future__ import annotations

from tinker import types

BASE = "ember-test/tiny-qwen3"


def rl_datum(prompt: list[int], seq: types.SampledSequence) -> types.Datum:
    tokens = prompt + seq.tokens
    pad = len(prompt) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": [0.0] * pad + seq.logprobs,
                                       "advantages": [0.0] * pad + [1.0] * len(seq.tokens)})


def test_the_gap_is_numerics_for_the_samplers_weights_and_grows_after_training(make_client):
    tc = make_client().create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    prompt = [5, 9, 14, 22, 31]
    sampler = tc.save_weights_and_get_sampling_client().result()
    seqs = sampler.sample(types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=6, seed=1)).result()
    data = [rl_datum(prompt, s) for s in seqs.sequences]
    fresh = tc.forward_backward(data, "importance_sampling").result().metrics
    assert fresh["sampler_tokens:sum"] == sum(len(s.tokens) for s in seqs.sequences)
    assert fresh["sampler_logprob_diff:max"] < 1e-4 and abs(fresh["sampler_mismatch_kl:mean"]) < 1e-6
    for _ in range(2):
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        stale = tc.forward_backward(data, "importance_sampling").result().metrics
    assert stale["sampler_logprob_diff:mean"] > 1e-3 and stale["sampler_mismatch_kl:mean"] > 0
