"""One request's fault in the shared sampling step fails that request alone.

Tenant A and tenant B sample at once through one TorchSampler; B's own work inside the
step (stop-string decoding, top-k logprobs, prompt scores, building its response) raises.
A's samples all complete, identical to A run alone with the same seed; B's error names
nothing of A's request; the sampler keeps serving. Oversized counts are clamped before
anything is allocated.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types

from ember import failpoints
from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler

from .conftest import params, prompt

A_PROMPT = [5, 6, 7, 8]
B_PROMPT = [9, 10, 11]


@pytest.fixture
def torch_sampler(tiny_model_dir):
    """A fresh sampler per test: the tests below replace parts of its scheduler."""
    s = TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(max_slots=16, max_len=256))
    yield s
    s.close()


def request_a(**kw) -> SamplingRequest:
    """Tenant A: no stop strings (so the tokenizer is never called for it), top-k logprobs."""
    base = dict(prompt=prompt(A_PROMPT), num_samples=3, sequence_ids=("alice-0", "alice-1", "alice-2"),
                sampling_params=params(max_tokens=12, temperature=0.9, seed=11, stop=[]), topk_sample_logprobs=3)
    return SamplingRequest(**{**base, **kw})


def request_b(**kw) -> SamplingRequest:
    base = dict(prompt=prompt(B_PROMPT), num_samples=2, sequence_ids=("bob-0", "bob-1"),
                sampling_params=params(max_tokens=12, temperature=1.0, seed=5, stop=["}}}}"]))
    return SamplingRequest(**{**base, **kw})


def assert_same_samples(got: types.SampleResponse, alone: types.SampleResponse) -> None:
    assert len(got.sequences) == len(alone.sequences)
    for g, a in zip(got.sequences, alone.sequences):
        assert g.tokens == a.tokens
        np.testing.assert_allclose(g.logprobs, a.logprobs, rtol=0, atol=1e-5)
        if a.topk_logprobs_np is not None:
            np.testing.assert_array_equal(g.topk_logprobs_np.token_ids, a.topk_logprobs_np.token_ids)
            np.testing.assert_allclose(g.topk_logprobs_np.logprobs, a.topk_logprobs_np.logprobs, rtol=0, atol=1e-5)
    if alone.prompt_logprobs_np is not None:
        np.testing.assert_allclose(got.prompt_logprobs_np, alone.prompt_logprobs_np, rtol=0, atol=1e-5)


def assert_names_nothing_of_a(error: Exception) -> None:
    msg = str(error)
    assert msg.startswith("sampling failed for this request: "), msg
    assert "alice" not in msg and str(A_PROMPT) not in msg


def run_together(sampler, a: SamplingRequest, b: SamplingRequest):
    """A and B submitted under one lock (admitted in the same step); A alone afterwards."""
    got_a, got_b = sampler.sample_many([a, b], timeout=60)
    assert isinstance(got_a, types.SampleResponse), got_a
    assert [s.sequence_id for s in got_a.sequences] == ["alice-0", "alice-1", "alice-2"]
    return got_a, got_b


def assert_keeps_serving(sampler, alone_a: types.SampleResponse) -> None:
    again = sampler.sample_many([request_a()], timeout=60)[0]
    assert isinstance(again, types.SampleResponse), again
    assert_same_samples(again, alone_a)


def test_stop_string_decode_failure_fails_only_that_request(torch_sampler):
    alone = torch_sampler.sample_many([request_a()], timeout=60)[0]
    # Only B has stop strings: its text is decoded once per sample per step. The first 4 decodes
    # pass, then B's fails once it has 3 tokens: inside a decode step, A in flight.
    failpoints.arm("sampler.stop_strings", "decodeerror", skip=4)
    try:
        got_a, got_b = run_together(torch_sampler, request_a(), request_b())
    finally:
        failpoints.disarm("sampler.stop_strings")
    assert isinstance(got_b, RuntimeError), got_b
    assert_names_nothing_of_a(got_b)
    assert "UnicodeDecodeError" in str(got_b)
    assert_same_samples(got_a, alone)
    assert_keeps_serving(torch_sampler, alone)
    assert torch_sampler.load() == {"active_slots": 0, "waiting_requests": 0}


def test_oversized_topk_counts_are_clamped_and_succeed(torch_sampler):
    alone = torch_sampler.sample_many([request_a()], timeout=60)[0]
    huge = request_b(topk_sample_logprobs=10**9, topk_prompt_logprobs=10**9, sampling_params=params(
        max_tokens=6, seed=5, stop=[]))
    got_a, got_b = run_together(torch_sampler, request_a(), huge)
    assert isinstance(got_b, types.SampleResponse), got_b
    vocab = torch_sampler.vocab_size
    assert got_b.topk_prompt_logprobs_np.token_ids.shape == (len(B_PROMPT), vocab)
    assert all(s.topk_logprobs_np.token_ids.shape == (6, vocab) for s in got_b.sequences)
    assert_same_samples(got_a, alone)
    assert_keeps_serving(torch_sampler, alone)


def test_topk_failure_in_the_batched_path_fails_only_that_request(torch_sampler):
    alone = torch_sampler.sample_many([request_a()], timeout=60)[0]
    # an allocation failure of B's large k: the batched computation (B's rows in it) and B's own fail
    failpoints.arm("sampler.top_logprobs", "oom", key="bob")
    try:
        got_a, got_b = run_together(torch_sampler, request_a(), request_b(topk_sample_logprobs=50))
    finally:
        failpoints.disarm("sampler.top_logprobs")
    assert isinstance(got_b, RuntimeError), got_b
    assert_names_nothing_of_a(got_b)
    # B's own computation: its 2 rows, not the batched 5 (A's 3 + B's 2).
    assert "MemoryError" in str(got_b) and "(2, " in str(got_b) and "(5, " not in str(got_b), str(got_b)
    assert_same_samples(got_a, alone)
    assert_keeps_serving(torch_sampler, alone)


def test_prompt_scores_failure_fails_only_that_request(torch_sampler):
    alone = torch_sampler.sample_many([request_a(include_prompt_logprobs=True)], timeout=60)[0]
    failpoints.arm("sampler.score_prompt", "raise", key="bob")  # B's prompt scoring fails, A's does not
    try:
        got_a, got_b = run_together(torch_sampler, request_a(include_prompt_logprobs=True),
                                    request_b(include_prompt_logprobs=True))
    finally:
        failpoints.disarm("sampler.score_prompt")
    assert isinstance(got_b, RuntimeError), got_b
    assert_names_nothing_of_a(got_b)
    assert_same_samples(got_a, alone)
    again = torch_sampler.sample_many([request_a(include_prompt_logprobs=True)], timeout=60)[0]
    assert_same_samples(again, alone)


@pytest.mark.parametrize("b_tokens", [3, 0])  # B finishes while A decodes / at admission (no token at all)
def test_response_failure_fails_only_that_request(torch_sampler, b_tokens):
    """Building B's finished sequence raises (here: at B's sequence id, a per-request value);
    B's other sample, finishing in the same step, is skipped rather than built from a freed slot."""
    alone = torch_sampler.sample_many([request_a()], timeout=60)[0]
    failpoints.arm("sampler.decode_request", "valueerror", key="bob")
    try:
        got_a, got_b = run_together(torch_sampler, request_a(),
                                    request_b(sampling_params=params(max_tokens=b_tokens, stop=[])))
    finally:
        failpoints.disarm("sampler.decode_request")
    assert isinstance(got_b, RuntimeError) and not isinstance(got_b, ValueError), got_b
    assert_names_nothing_of_a(got_b)
    assert_same_samples(got_a, alone)


def test_fail_point_fails_one_request_and_the_sampler_serves_on(torch_sampler):
    failpoints.arm("sampler.decode_request", "raise", times=1)
    try:
        failed = torch_sampler.sample_many([request_b(num_samples=1, sequence_ids=None)], timeout=60)[0]
    finally:
        failpoints.disarm("sampler.decode_request")
    assert isinstance(failed, RuntimeError) and "fail point sampler.decode_request" in str(failed), failed
    alone = torch_sampler.sample_many([request_a()], timeout=60)[0]
    assert isinstance(alone, types.SampleResponse)


def test_forward_failure_message_names_no_request(torch_sampler):
    """A failure of the shared forward still fails what is in flight, without its shapes."""
    from ember.sampling.weights import TorchWeightVersion

    broken = TorchWeightVersion(torch_sampler.debug_state()["sampler_id"], params={"lm_head.weight": torch.zeros(84, 63)})
    bad = torch_sampler.sample_many([request_b(version=broken)], timeout=60)[0]
    assert isinstance(bad, RuntimeError)
    assert str(bad).startswith("sampling failed: the batched model forward raised ")
    assert "63" not in str(bad) and "84" not in str(bad), str(bad)


# ------------------------------------------------------------------ clamps (pure: no model)
def _resolve(request: SamplingRequest, vocab: int = 84):
    from ember.sampling.params import resolve_request

    return resolve_request(request, vocab_size=vocab, eos_token_ids=(1,), max_len=256, default_max_tokens=8,
                           default_logprobs_mode="raw", can_decode=True)


def test_prompt_logprobs_last_n_is_clamped_to_the_prompt():
    spec = _resolve(SamplingRequest(prompt=prompt([5, 6, 7]), include_prompt_logprobs=True,
                                    prompt_logprobs_last_n=10**9))
    assert spec.prompt_logprobs_last_n is None  # every scorable position: the same as unset
    assert _resolve(SamplingRequest(prompt=prompt([5, 6, 7]), include_prompt_logprobs=True,
                                    prompt_logprobs_last_n=2)).prompt_logprobs_last_n is None
    assert _resolve(SamplingRequest(prompt=prompt([5, 6, 7]), include_prompt_logprobs=True,
                                    prompt_logprobs_last_n=1)).prompt_logprobs_last_n == 1
    one = _resolve(SamplingRequest(prompt=prompt([5]), include_prompt_logprobs=True, prompt_logprobs_last_n=3))
    assert one.prompt_logprobs_last_n is None


def test_topk_counts_are_clamped_to_the_vocabulary():
    spec = _resolve(SamplingRequest(prompt=prompt([5, 6]), topk_prompt_logprobs=10**9, topk_sample_logprobs=10**9))
    assert spec.topk_prompt_logprobs == 84 and spec.topk_sample_logprobs == 84


def test_clamped_last_n_scores_the_whole_prompt(torch_sampler):
    p = prompt([5, 6, 7, 8])
    full = torch_sampler.sample(p, 1, params(max_tokens=1), include_prompt_logprobs=True, timeout=60)
    huge = torch_sampler.sample(p, 1, params(max_tokens=1), include_prompt_logprobs=True, topk_prompt_logprobs=10**9,
                          prompt_logprobs_last_n=10**9, timeout=60)
    np.testing.assert_allclose(huge.prompt_logprobs_np, full.prompt_logprobs_np, rtol=0, atol=1e-6)
    assert huge.topk_prompt_logprobs_np.token_ids.shape == (4, torch_sampler.vocab_size)
