"""Mid-sequence adoption of in-flight weights (ember.sampling.follow): a followed request's
running sequence switches to a newly published version at its next decode step, keeping
the KV cache of its earlier tokens, and records which generation produced which tokens."""

from __future__ import annotations

import numpy as np
import pytest

from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler
from ember.sampling.follow import VersionFollower, spans_a_swap, version_spans

from .conftest import mixed_cache_logprobs, old_logprobs, params, perturbed, prompt

PROMPT = [5, 6, 7, 8, 9]
SWAP_AFTER = 4  # the new version is published once this many tokens were streamed
MAX_TOKENS = 12


def test_a_sequence_spanning_a_swap_records_it_and_runs_the_new_weights_on_the_old_cache(tiny_model_dir,
                                                                                         ref_model):
    newer = perturbed(ref_model, seed=7)
    with TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(max_slots=4)) as sampler:
        assert sampler.follows_mid_sequence
        follow = VersionFollower(None)  # generation 0: the base weights
        v1 = sampler.load_weights(newer.state_dict().items())
        streamed: list[int] = []

        def on_tokens(sample, tokens, logprobs):  # the step hook: runs on the sampler's thread
            streamed.extend(tokens)
            if len(streamed) >= SWAP_AFTER and follow.current()[0] == 0:
                follow.publish(v1)

        request = SamplingRequest(prompt=prompt(PROMPT), follow=follow, on_tokens=on_tokens,
                                  sampling_params=params(max_tokens=MAX_TOKENS, temperature=0.0, stop=[]))
        seq = sampler.submit(request).result(timeout=300).sequences[0]
    swap = version_spans(seq)[1][0]
    assert version_spans(seq) == ((0, 0), (swap, 1)) and spans_a_swap(seq)
    assert SWAP_AFTER <= swap < MAX_TOKENS
    tokens, logprobs = PROMPT + list(seq.tokens), np.asarray(seq.logprobs_np)
    first_new = len(PROMPT) + swap
    np.testing.assert_allclose(logprobs[:swap], old_logprobs(ref_model, tokens, first_new)[-swap:], rtol=0, atol=1e-4)
    np.testing.assert_allclose(logprobs[swap:], mixed_cache_logprobs(ref_model, newer, tokens, first_new),
                               rtol=0, atol=1e-4)
    stayed_old = old_logprobs(ref_model, tokens, len(tokens) + 1)[-(len(tokens) - first_new):]
    assert np.abs(logprobs[swap:] - stayed_old).max() > 1e-2  # the swap changed what was computed


def test_an_unfollowed_request_carries_no_spans(tiny_model_dir):
    with TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(max_slots=4)) as sampler:
        request = SamplingRequest(prompt=prompt(PROMPT), sampling_params=params(max_tokens=3, temperature=0.0))
        seq = sampler.submit(request).result(timeout=300).sequences[0]
    assert version_spans(seq) is None and not spans_a_swap(seq)


def test_a_follower_names_the_generation_of_each_published_version():
    first, second = object(), object()
    follow = VersionFollower(first)
    assert follow.publish(second) == 1 and follow.current() == (1, second)
    assert follow.generation_of(first) == 0 and follow.generation_of(second) == 1
    with pytest.raises(ValueError, match="never published"):
        follow.generation_of(object())


def test_listeners_hear_each_publish_once_and_a_mirror_adopts_only_newer_generations():
    first, second, third = object(), object(), object()
    follow, heard = VersionFollower(first), []
    follow.subscribe(lambda g, v: heard.append((g, v)))
    listener = lambda g, v: heard.append(("again", g))  # noqa: E731
    follow.subscribe(listener)
    follow.subscribe(listener)  # once per listener
    follow.publish(second)
    assert heard == [(1, second), ("again", 1)]
    mirror, mirrored = VersionFollower(first), []
    mirror.subscribe(lambda g, v: mirrored.append(g))
    assert mirror.adopt(third, 2) == 2 and mirror.current() == (2, third)
    assert mirror.adopt(second, 1) == 2 and mirror.current() == (2, third)  # a late forward: kept, not current
    assert mirrored == [2]  # listeners hear a change of the current version only
    assert mirror.generation_of(second) == 1 and mirror.generation_of(third) == 2
