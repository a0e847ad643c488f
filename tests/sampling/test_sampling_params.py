"""Configuration, request validation and the counter-based RNG."""

from __future__ import annotations

import re

import numpy as np
import pytest
from tinker import types

from ember.sampling import SamplerConfig, SamplingRequest
from ember.sampling import rng
from ember.sampling.params import resolve_stop

from .conftest import params, prompt


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_slots": 0}, "max_slots"),
        ({"max_len": 1}, "max_len"),
        ({"default_max_tokens": -3}, "default_max_tokens"),
        ({"logprobs_mode": "sampled"}, "logprobs_mode"),
        ({"dtype": "float8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"attn_implementation": "flash_attention_2"}, "attn_implementation"),
    ],
)
def test_sampler_config_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplerConfig(**kwargs)


def test_resolve_stop_variants():
    eos = (1,)
    assert resolve_stop(None, eos, 84) == ((1,), ())
    assert resolve_stop([], eos, 84) == ((), ())
    assert resolve_stop("\n", eos, 84) == ((1,), ("\n",))
    assert resolve_stop(["ab", "c"], eos, 84) == ((1,), ("ab", "c"))
    assert resolve_stop([7, 9], eos, 84) == ((7, 9, 1), ())
    with pytest.raises(ValueError, match=r"stop\[1\].*\[0, 84\)"):
        resolve_stop([7, 84], eos, 84)
    with pytest.raises(ValueError, match="stop"):
        resolve_stop([7, "x"], eos, 84)
    with pytest.raises(ValueError, match="non-empty"):
        resolve_stop([""], eos, 84)


BAD = [
    (SamplingRequest(prompt=prompt([5, 6]), sampling_params=params(max_tokens=-1)), r"max_tokens.*>= 0.*-1"),
    (SamplingRequest(prompt=prompt([5, 6]), sampling_params=params(top_p=0.0)), r"top_p.*\(0, 1\]"),
    (SamplingRequest(prompt=prompt([5, 6]), sampling_params=params(top_p=1.5)), r"top_p.*1.5"),
    (SamplingRequest(prompt=prompt([5, 6]), sampling_params=params(top_k=0)), r"top_k"),
    (SamplingRequest(prompt=prompt([5, 6]), sampling_params=params(temperature=-1.0)), r"temperature"),
    (SamplingRequest(prompt=prompt([5, 84])), r"prompt token 1.*\[0, 84\).*84"),
    (SamplingRequest(prompt=prompt([-1, 5])), r"prompt token 0.*-1"),
    (SamplingRequest(prompt=prompt([])), r"prompt.*empty"),
    (SamplingRequest(prompt=prompt([5, 6]), sampling_params=params(stop=[3, 99])), r"stop\[1\]"),
    (SamplingRequest(prompt=prompt([5, 6]), num_samples=0), r"num_samples"),
    (SamplingRequest(prompt=prompt([5, 6]), include_prompt_logprobs=True, prompt_logprobs_last_n=0),
     r"prompt_logprobs_last_n.*>= 1.*0"),
    (SamplingRequest(prompt=prompt([7] * 256)), r"prompt.*fewer than 256"),
]


def test_bad_requests_fail_alone(sampler):
    good = SamplingRequest(prompt=prompt([5, 6, 7]), num_samples=2,
                           sampling_params=params(max_tokens=4, seed=3, stop=[]))
    requests = [good] + [r for r, _ in BAD] + [good]
    results = sampler.sample_many(requests, timeout=60)
    for (_, pattern), result in zip(BAD, results[1:-1]):
        assert isinstance(result, ValueError), result
        assert re.search(pattern, str(result)), (pattern, str(result))
    for result in (results[0], results[-1]):
        assert isinstance(result, types.SampleResponse)
        assert [len(s.tokens) for s in result.sequences] == [4, 4]
    # The sampler keeps serving afterwards, with identical results for identical requests.
    again = sampler.sample(prompt([5, 6, 7]), 2, params(max_tokens=4, seed=3, stop=[]))
    assert [s.tokens for s in again.sequences] == [s.tokens for s in results[0].sequences]


def test_foreign_version_rejected(sampler, tiny_model_dir):
    from ember.sampling import TorchSampler

    other = TorchSampler.from_pretrained(tiny_model_dir)
    v = other.load_weights(dict(other.model.state_dict()))
    with pytest.raises(ValueError, match="version"):
        sampler.sample(prompt([5, 6]), 1, params(max_tokens=2), version=v)
    other.close()


def test_rng_is_pure_and_uniform():
    keys = rng.sample_keys(1234, 3)
    assert len(set(keys.tolist())) == 3
    assert np.array_equal(keys, rng.sample_keys(1234, 3))
    assert not np.array_equal(keys, rng.sample_keys(1235, 3))
    u = rng.uniforms(np.repeat(keys[:1], 20000), np.arange(20000))
    assert u.min() >= 0.0 and u.max() < 1.0
    # Mean and variance of U(0,1) within 5 standard errors.
    assert abs(u.mean() - 0.5) < 5 * (1 / 12) ** 0.5 / 20000**0.5
    assert abs(u.var() - 1 / 12) < 0.005
    assert np.array_equal(u[:5], rng.uniforms(np.repeat(keys[:1], 5), np.arange(5)))
