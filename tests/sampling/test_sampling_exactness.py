"""The sampler computes the same function as a plain full forward (fp32 CPU, abs 1e-4):
sampled-token logprobs, prompt logprobs, top-k logprobs, greedy decoding."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tinker import types

from ember.models import load_model
from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler

from .conftest import full_logprobs, greedy_reference, params, prompt

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23], [30]]


def test_sampled_logprobs_match_full_forward(sampler, ref_model):
    # Prompts of different lengths in one prefill (left padding) and decode batch,
    # several samples per prompt (shared prefill), slots of different lengths.
    requests = [
        SamplingRequest(prompt=prompt(p), num_samples=3, sampling_params=params(max_tokens=12, seed=i, stop=[]))
        for i, p in enumerate(PROMPTS)
    ]
    worst = 0.0
    for p, resp in zip(PROMPTS, sampler.sample_many(requests, timeout=300)):
        assert isinstance(resp, types.SampleResponse)
        for seq in resp.sequences:
            assert len(seq.tokens) == 12 and seq.stop_reason == "length"
            ref = full_logprobs(ref_model, p + seq.tokens)[len(p) - 1:]
            worst = max(worst, float((torch.tensor(seq.logprobs) - ref).abs().max()))
    assert worst < 1e-4, worst


def test_prompt_logprobs_and_topk_match_full_forward(sampler, ref_model):
    p = PROMPTS[0]
    resp = sampler.sample(prompt(p), 1, params(max_tokens=1), include_prompt_logprobs=True, topk_prompt_logprobs=5)
    assert resp.prompt_logprobs[0] is None and math.isnan(resp.prompt_logprobs_np[0])
    ref = full_logprobs(ref_model, p)
    assert np.allclose(resp.prompt_logprobs[1:], ref.numpy(), atol=1e-4)
    with torch.no_grad():
        logp = torch.log_softmax(ref_model(torch.tensor([p])).logits[0, :-1], dim=-1)
    vals, ids = torch.topk(logp, 5, dim=-1)
    topk = resp.topk_prompt_logprobs
    assert topk[0] is None and len(topk) == len(p)
    for i in range(1, len(p)):
        assert [t for t, _ in topk[i]] == ids[i - 1].tolist()
        assert np.allclose([lp for _, lp in topk[i]], vals[i - 1].numpy(), atol=1e-4)
    # compute_logprobs is the same list; prompt_logprobs_last_n blanks the earlier entries.
    assert np.allclose(sampler.compute_logprobs(prompt(p))[1:], ref.numpy(), atol=1e-4)
    last = sampler.compute_logprobs(prompt(p), prompt_logprobs_last_n=2)
    assert last[:-2] == [None] * (len(p) - 2)
    assert np.allclose(last[-2:], ref.numpy()[-2:], atol=1e-4)


def test_topk_sample_logprobs(sampler, ref_model):
    p = PROMPTS[2]
    seq = sampler.sample(prompt(p), 1, params(max_tokens=6, seed=5, stop=[]), topk_sample_logprobs=4).sequences[0]
    with torch.no_grad():
        logits = ref_model(torch.tensor([p + seq.tokens])).logits[0, len(p) - 1: -1]
    vals, ids = torch.topk(torch.log_softmax(logits, dim=-1), 4, dim=-1)
    assert len(seq.topk_logprobs) == 6
    for i, row in enumerate(seq.topk_logprobs):
        assert [t for t, _ in row] == ids[i].tolist()
        assert np.allclose([lp for _, lp in row], vals[i].numpy(), atol=1e-4)


def test_greedy_equals_argmax_decode(sampler, ref_model):
    requests = [
        SamplingRequest(prompt=prompt(p), num_samples=2, sampling_params=params(max_tokens=10, temperature=0.0, stop=[]))
        for p in PROMPTS
    ]
    for p, resp in zip(PROMPTS, sampler.sample_many(requests, timeout=300)):
        want = greedy_reference(ref_model, p, 10)
        assert [seq.tokens for seq in resp.sequences] == [want, want]
    # temperature -> 0 (tiny but positive) behaves greedily too.
    tiny_t = sampler.sample(prompt(PROMPTS[0]), 1, params(max_tokens=10, temperature=1e-6, seed=1, stop=[]))
    assert tiny_t.sequences[0].tokens == greedy_reference(ref_model, PROMPTS[0], 10)


def test_greedy_equals_argmax_decode_llama(tiny_llama_dir):
    ref = load_model(tiny_llama_dir).eval()
    with TorchSampler.from_pretrained(tiny_llama_dir, SamplerConfig(max_slots=4)) as s:
        requests = [
            SamplingRequest(prompt=prompt(p), num_samples=2,
                            sampling_params=params(max_tokens=10, temperature=0.0, stop=[]))
            for p in PROMPTS
        ]
        for p, resp in zip(PROMPTS, s.sample_many(requests, timeout=300)):
            want = greedy_reference(ref, p, 10)
            assert [seq.tokens for seq in resp.sequences] == [want, want]


def test_eager_attention_backend_matches(tiny_model_dir, ref_model):
    # eager attention takes an additive float mask instead of sdpa's boolean one
    cfg = SamplerConfig(max_slots=4, attn_implementation="eager")
    with TorchSampler.from_pretrained(tiny_model_dir, cfg) as s:
        assert s.model.config._attn_implementation == "eager"
        requests = [SamplingRequest(prompt=prompt(p), num_samples=2,
                                    sampling_params=params(max_tokens=6, seed=i, stop=[]))
                    for i, p in enumerate(PROMPTS)]
        for p, resp in zip(PROMPTS, s.sample_many(requests, timeout=300)):
            for seq in resp.sequences:
                ref = full_logprobs(ref_model, p + seq.tokens)[len(p) - 1:]
                assert float((torch.tensor(seq.logprobs) - ref).abs().max()) < 1e-4
