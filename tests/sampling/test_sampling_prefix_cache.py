"""TorchSampler's prefix cache: a repeated prompt reuses its prefix's KV
(`prompt_cache_hit_tokens` > 0) with the same logprobs (fp32, 1e-5) and seeded tokens;
never across weight versions / adapters; bounded (LRU); dropped with its version."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from helpers.datums import random_sft_datums
from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler

LONG = [int(t) for t in np.random.default_rng(0).integers(1, 80, size=40)]  # block 16 → 32 cached


def _req(tokens, version=None, last_n=4, **kw) -> SamplingRequest:
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    return SamplingRequest(prompt=types.ModelInput.from_ints(tokens), num_samples=2, sampling_params=params,
                           version=version, include_prompt_logprobs=True, prompt_logprobs_last_n=last_n, **kw)


# `make test-fast` runs the cache on the direct forward (the conformance tests run both forwards there).
@pytest.fixture(params=["direct", pytest.param("transformers", marks=pytest.mark.slow)])
def cached(request, tiny_model_dir):
    cfg = SamplerConfig(max_slots=8, forward=request.param, prefix_cache_tokens=64, prefix_cache_block=16)
    with TorchSampler.from_pretrained(tiny_model_dir, cfg) as s:
        yield s


def _same(a: types.SampleResponse, b: types.SampleResponse) -> None:
    np.testing.assert_allclose(np.asarray(a.prompt_logprobs_np), np.asarray(b.prompt_logprobs_np), atol=1e-5, rtol=0)
    for x, y in zip(a.sequences, b.sequences, strict=True):
        assert x.tokens == y.tokens
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5, rtol=0)


def test_repeated_prompt_hits_with_identical_results(cached, tiny_model_dir):
    first = cached.submit(_req(LONG)).result(60)
    second = cached.submit(_req(LONG)).result(60)
    assert first.prompt_cache_hit_tokens == 0 and second.prompt_cache_hit_tokens == 32
    _same(first, second)
    longer = cached.submit(_req(LONG + [3, 4])).result(60)  # shares the 32-token prefix
    assert longer.prompt_cache_hit_tokens == 32
    with TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(max_slots=8, prefix_cache_tokens=0)) as off:
        plain = off.submit(_req(LONG + [3, 4])).result(60)
        assert plain.prompt_cache_hit_tokens == 0
    _same(longer, plain)


def test_scores_before_the_prefix_limit_the_hit(cached, ref_model):
    cached.submit(_req(LONG)).result(60)
    whole = cached.submit(_req(LONG, last_n=None)).result(60)  # every position scored: nothing reused
    assert whole.prompt_cache_hit_tokens == 0
    targets = types.TensorData.from_numpy(np.array(LONG[1:], np.int64)[:, None])
    with_targets = cached.submit(_req(LONG, target_prompt_logprobs=targets)).result(60)
    assert with_targets.prompt_cache_hit_tokens == 0
    tail = cached.submit(_req(LONG, last_n=20)).result(60)  # positions 19.. scored: 16 reusable
    assert tail.prompt_cache_hit_tokens == 16
    np.testing.assert_allclose(tail.prompt_logprobs_np[-20:], whole.prompt_logprobs_np[-20:], atol=1e-5, rtol=0)


def test_no_hit_across_versions_or_adapters_and_released_versions_are_dropped(cached, tiny_model_dir):
    cfg = types.LoraConfig(rank=2, seed=1, train_unembed=False)
    engine = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(), lora_config=cfg)
    engine.forward_backward(random_sft_datums(4, 84, seed=3), "cross_entropy")
    engine.optim_step(types.AdamParams(learning_rate=2e-2))
    la = cached.load_weights(engine.named_weights(), lora_config=cfg)
    lb = cached.load_weights(engine.named_weights(), lora_config=cfg)  # same numbers, another version
    full = cached.load_weights(TorchEngine.from_pretrained(tiny_model_dir, EngineConfig()).named_weights())
    assert cached.submit(_req(LONG)).result(60).prompt_cache_hit_tokens == 0
    for v in (la, lb, full):  # the cache holds two prompts: each version's right after its miss
        assert cached.submit(_req(LONG, version=v)).result(60).prompt_cache_hit_tokens == 0
        assert cached.submit(_req(LONG, version=v)).result(60).prompt_cache_hit_tokens == 32
    before = cached.prefix_cache.cached_tokens()
    del la, lb, full
    gc.collect()
    assert cached.prefix_cache.cached_tokens() < before  # released versions' entries are gone


def test_cache_is_bounded_lru(cached):
    others = [[(t + k) % 80 + 1 for t in LONG] for k in range(1, 4)]
    for tokens in [LONG, *others]:
        cached.submit(_req(tokens)).result(60)
        assert cached.prefix_cache.cached_tokens() <= 64
    assert cached.submit(_req(LONG)).result(60).prompt_cache_hit_tokens == 0  # evicted (least recently used)
    assert cached.submit(_req(others[-1])).result(60).prompt_cache_hit_tokens == 32


def test_config_refuses_bad_sizes():
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        SamplerConfig(prefix_cache_tokens=-1)
    with pytest.raises(ValueError, match="prefix_cache_block"):
        SamplerConfig(prefix_cache_block=0)


def test_snapshot_is_a_copy(cached):
    """An entry must not alias a slot that later requests overwrite."""
    cached.submit(_req(LONG)).result(60)
    entry = cached.prefix_cache.debug_state()["snapshots"][0]
    keep = [k.clone() for k, _ in entry]
    cached.submit(_req(others := [(t + 7) % 80 + 1 for t in LONG])).result(60)
    assert others and all(torch.equal(a, k) for a, (k, _) in zip(keep, entry))
