"""vLLM adopts in-flight weights mid-sequence (ember.sampling.vllm_follow): a publish heard
while a followed request runs pauses the engine between steps, loads the new weights in
place (a full set, or the follow slot's LoRA adapter), and resumes; the sequence records
where the swap fell, and its later tokens ran on the new weights over the old KV cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler
from ember.sampling.follow import VersionFollower, version_spans

from .conftest import mixed_cache_logprobs, old_logprobs, params, perturbed, prompt

pytestmark = [pytest.mark.slow, pytest.mark.needs_vllm]

PROMPT = [5, 6, 7, 8, 9]
SWAP_AFTER = 4  # the publish happens once this many tokens were streamed
MAX_TOKENS = 160  # room for the engine to run on while the pause request travels to it


def _followed(sampler, follow: VersionFollower, version, publish, publish_after: int) -> types.SampledSequence:
    """Greedy sample of PROMPT following `follow`; `publish` is published from the stream
    hook once `publish_after` tokens were streamed (the hook runs on the sampler's thread)."""
    streamed: list[int] = []

    def on_tokens(sample, tokens, logprobs):
        streamed.extend(tokens)
        if len(streamed) >= publish_after and follow.current()[1] is not publish:
            follow.publish(publish)

    request = SamplingRequest(prompt=prompt(PROMPT), version=version, follow=follow, on_tokens=on_tokens,
                              sampling_params=params(max_tokens=MAX_TOKENS, temperature=0.0, stop=[]))
    return sampler.submit(request).result(timeout=300).sequences[0]


def test_full_weights_swap_mid_sequence_on_the_old_cache(vllm_sampler, ref_model):
    newer = perturbed(ref_model, seed=11)
    v1 = vllm_sampler.load_weights(newer.state_dict().items())
    adoptions = vllm_sampler.debug_state()["inflight_adoptions"]
    seq = _followed(vllm_sampler, VersionFollower(None), None, v1, SWAP_AFTER)
    spans = version_spans(seq)
    assert len(spans) == 2, spans
    swap = spans[1][0]
    assert spans == ((0, 0), (swap, 1)) and SWAP_AFTER <= swap < MAX_TOKENS
    assert vllm_sampler.debug_state()["inflight_adoptions"] == adoptions + 1
    tokens, logprobs = PROMPT + list(seq.tokens), np.asarray(seq.logprobs_np)
    first_new = len(PROMPT) + swap
    # exact boundary: token swap - 1 ran on the old weights, token swap on the new (1e-4: fp32 CPU)
    np.testing.assert_allclose(logprobs[:swap], old_logprobs(ref_model, tokens, first_new)[-swap:], rtol=0, atol=1e-4)
    np.testing.assert_allclose(logprobs[swap:], mixed_cache_logprobs(ref_model, newer, tokens, first_new),
                               rtol=0, atol=1e-4)


def _lora_versions(model_dir, samplers, seeds=(3, 4)):
    """Two LoRA adapters with non-zero deltas (B moved by noise), loaded into each sampler."""
    cfg = types.LoraConfig(rank=4, seed=2)
    engine = TorchEngine.from_pretrained(model_dir, EngineConfig(), lora_config=cfg)
    out = []
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        weights = {name: t.detach() + 0.2 * torch.randn(t.shape, generator=gen) for name, t in engine.named_weights()}
        out.append([s.load_weights(weights.items(), lora_config=cfg) for s in samplers])
    return out


def test_a_lora_adapter_swaps_in_place_and_matches_torchsampler_swapping_at_the_same_token(
        vllm_sampler, tiny_model_dir):
    with TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(max_slots=4, max_len=256)) as torch_sampler:
        (a_vllm, a_torch), (b_vllm, b_torch) = _lora_versions(tiny_model_dir, [vllm_sampler, torch_sampler])
        seq = _followed(vllm_sampler, VersionFollower(a_vllm), a_vllm, b_vllm, SWAP_AFTER)
        spans = version_spans(seq)
        assert len(spans) == 2, spans
        swap = spans[1][0]
        assert spans == ((0, 0), (swap, 1)) and SWAP_AFTER <= swap < MAX_TOKENS
        # the reference: TorchSampler adopts before the decode step after the hook's publish
        ref = _followed(torch_sampler, VersionFollower(a_torch), a_torch, b_torch, swap)
    assert version_spans(ref) == spans
    assert list(seq.tokens) == list(ref.tokens)
    np.testing.assert_allclose(seq.logprobs_np, ref.logprobs_np, rtol=0, atol=1e-4)
    never = vllm_sampler.sample(prompt(PROMPT), 1, params(max_tokens=MAX_TOKENS, temperature=0.0, stop=[]),
                                version=a_vllm, timeout=300).sequences[0]
    np.testing.assert_allclose(never.logprobs_np[:swap], seq.logprobs_np[:swap], rtol=0, atol=1e-4)
    assert np.abs(np.asarray(never.logprobs_np[swap:]) - seq.logprobs_np[swap:]).max() > 1e-2


def test_requests_after_a_publish_start_on_it_and_unfollowed_ones_stay_on_their_version(vllm_sampler,
                                                                                          tiny_model_dir):
    (a, b) = [v for (v,) in _lora_versions(tiny_model_dir, [vllm_sampler], seeds=(5, 6))]
    follow = VersionFollower(a)
    short = params(max_tokens=6, temperature=0.0, stop=[])
    follow.publish(b)  # heard before any followed request ran: the slot starts on it
    seq = vllm_sampler.submit(SamplingRequest(prompt=prompt(PROMPT), version=a, follow=follow,
                                              sampling_params=short)).result(timeout=300).sequences[0]
    assert version_spans(seq) == ((0, 1),)
    on_b = vllm_sampler.sample(prompt(PROMPT), 1, short, version=b, timeout=300).sequences[0]
    on_a = vllm_sampler.sample(prompt(PROMPT), 1, short, version=a, timeout=300).sequences[0]
    np.testing.assert_allclose(seq.logprobs_np, on_b.logprobs_np, rtol=0, atol=1e-4)
    assert np.abs(np.asarray(on_a.logprobs_np) - np.asarray(on_b.logprobs_np)).max() > 1e-2  # a stayed a
    adoptions = vllm_sampler.debug_state()["inflight_adoptions"]
    follow.publish(a)  # generation 2, heard while nothing follows: the slot's adapter is replaced, no pause
    again = vllm_sampler.submit(SamplingRequest(prompt=prompt(PROMPT), version=b, follow=follow,
                                                sampling_params=short)).result(timeout=300).sequences[0]
    assert version_spans(again) == ((0, 2),)
    np.testing.assert_allclose(again.logprobs_np, on_a.logprobs_np, rtol=0, atol=1e-4)
    assert vllm_sampler.debug_state()["inflight_adoptions"] == adoptions
