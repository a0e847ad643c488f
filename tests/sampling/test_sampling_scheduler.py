"""The scheduler's loop on its own, driven as its module docstring shows: `enqueue`, then
`step()` while `busy`; a failure of the shared work fails the requests in flight and
leaves the waiting ones to be served; closing fails the waiting ones too."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest
import torch
from tinker import types

from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler

from .conftest import params, prompt


CONFIG = SamplerConfig(max_slots=2, max_len=64)  # three requests of two samples cannot all decode at once


@pytest.fixture
def small_sampler(tiny_model_dir):
    """A sampler whose scheduler the test drives itself (nothing is submitted to it, so its
    worker thread never runs)."""
    with TorchSampler.from_pretrained(tiny_model_dir, CONFIG) as s:
        yield s


@pytest.fixture
def expected(tiny_model_dir):
    """The responses of the same requests, submitted to a sampler of the same config."""
    with TorchSampler.from_pretrained(tiny_model_dir, CONFIG) as s:
        return s.sample_many(_requests(), timeout=60)


def _requests() -> list[SamplingRequest]:
    return [SamplingRequest(prompt=prompt([5 + i, 6, 7 + i]), num_samples=2,
                            sampling_params=params(max_tokens=6, temperature=0.9, seed=100 + i, stop=[]))
            for i in range(3)]


def _jobs(sampler, requests):
    return [sampler.make_job(request, Future()) for request in requests]


def _step(scheduler) -> None:
    with torch.inference_mode():  # as the sampler's worker thread runs it
        scheduler.step()


def _run(scheduler) -> int:
    steps = 0
    while scheduler.busy:
        _step(scheduler)
        steps += 1
    return steps


def test_enqueue_and_step_serve_every_request_as_the_sampler_does(small_sampler, expected):
    scheduler = small_sampler.scheduler
    jobs = _jobs(small_sampler, _requests())
    scheduler.enqueue(jobs)
    steps = _run(scheduler)
    # 6 samples through 2 slots: 3 rounds of 6 tokens, each 5 steps (the first step admits,
    # drawing token 1, and decodes token 2; then one token per step).
    assert steps == 3 * 5, steps
    for job, want in zip(jobs, expected):
        got = job.future.result(timeout=0)
        assert isinstance(got, types.SampleResponse)
        for seq, want_seq in zip(got.sequences, want.sequences, strict=True):
            assert seq.tokens == want_seq.tokens
            np.testing.assert_array_equal(seq.logprobs, want_seq.logprobs)  # same schedule: same bits
    assert scheduler.load() == {"active_slots": 0, "waiting_requests": 0} and not scheduler.in_flight()


def test_fail_in_flight_fails_the_slot_holders_and_the_rest_are_served(small_sampler, expected):
    scheduler = small_sampler.scheduler
    first, second, third = _jobs(small_sampler, _requests())
    scheduler.enqueue([first, second, third])
    _step(scheduler)  # the first request's two samples take both slots
    assert [r.job for r in scheduler.in_flight()] == [first]
    scheduler.fail_in_flight(RuntimeError("the shared forward broke"))
    with pytest.raises(RuntimeError, match="the shared forward broke"):
        first.future.result(timeout=0)
    assert scheduler.load()["active_slots"] == 0
    _run(scheduler)
    for job, want in [(second, expected[1]), (third, expected[2])]:
        assert [s.tokens for s in job.future.result(timeout=0).sequences] == [s.tokens for s in want.sequences]


def test_fail_everything_fails_waiting_and_in_flight_requests(small_sampler):
    scheduler = small_sampler.scheduler
    jobs = _jobs(small_sampler, _requests())
    scheduler.enqueue(jobs)
    _step(scheduler)
    scheduler.fail_everything(RuntimeError("the sampler was closed"))
    for job in jobs:
        with pytest.raises(RuntimeError, match="the sampler was closed"):
            job.future.result(timeout=0)
    assert not scheduler.busy and not scheduler.in_flight()
