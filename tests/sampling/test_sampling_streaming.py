"""Streaming (`SamplingRequest.on_tokens`, `submit_streaming`) and cancellation on
TorchSampler: tokens reach the callback as they are decoded, equal to the final response;
a cancelled request frees its slot at the next step and another request gets it; a
backend that does not stream replays each sequence at the end."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch

from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler
from ember.sampling.base import submit_streaming

from .conftest import backend_param, params, prompt

CONFIG = SamplerConfig(max_slots=1, max_len=128)  # one slot: a request that holds it blocks every other one


@pytest.fixture
def one_slot(tiny_model_dir):
    with TorchSampler.from_pretrained(tiny_model_dir, CONFIG) as s:
        yield s


class Collector:
    """on_tokens: what arrived per sample, and whether the request's Future was done at each call."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[float]] = {}
        self.done_at_call: list[bool] = []
        self.future: Future | None = None

    def __call__(self, sample: int, tokens, logprobs) -> None:
        self.tokens.setdefault(sample, []).extend(tokens)
        self.logprobs.setdefault(sample, []).extend(logprobs)
        self.done_at_call.append(self.future is not None and self.future.done())


def _request(on_tokens=None, max_tokens=12, n=2, seed=3) -> SamplingRequest:
    return SamplingRequest(prompt=prompt([5, 6, 7]), num_samples=n, on_tokens=on_tokens,
                           sampling_params=params(max_tokens=max_tokens, temperature=0.9, seed=seed, stop=[]))


@pytest.mark.parametrize("sampler", [backend_param("direct"), backend_param("vllm", pytest.mark.needs_vllm)],
                         indirect=True)
def test_tokens_stream_as_decoded_and_equal_the_response(sampler):
    collect = Collector()
    future = submit_streaming(sampler, _request(collect, max_tokens=40))
    collect.future = future
    response = future.result(timeout=300)
    assert len(collect.done_at_call) >= 2 and not collect.done_at_call[0]  # the first tokens came before the end
    for i, seq in enumerate(response.sequences):
        assert collect.tokens[i] == list(seq.tokens)
        assert collect.logprobs[i] == pytest.approx(list(seq.logprobs), abs=1e-6)


def test_torch_sampler_calls_back_once_per_token(tiny_model_dir):
    with TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(max_slots=4, max_len=128)) as sampler:
        collect = Collector()
        future = submit_streaming(sampler, _request(collect))
        collect.future = future
        future.result(timeout=120)
    assert len(collect.done_at_call) == 2 * 12 and not any(collect.done_at_call)


def test_a_backend_that_does_not_stream_replays_each_sequence_at_the_end(tiny_model_dir):
    with TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(max_slots=4, max_len=128)) as sampler:
        sampler.streams_tokens = False  # as a backend without the capability
        collect = Collector()
        response = submit_streaming(sampler, _request(collect)).result(timeout=120)
    assert len(collect.done_at_call) == 2  # one call per sequence, with all its tokens, once it is done
    assert [collect.tokens[i] for i in range(2)] == [list(s.tokens) for s in response.sequences]


def test_a_cancelled_request_frees_its_slot_for_the_next(one_slot):
    scheduler = one_slot.scheduler
    first = Future()
    scheduler.enqueue([one_slot.make_job(_request(max_tokens=100, n=1), first)])
    with torch.inference_mode():
        for _ in range(3):
            scheduler.step()
        assert scheduler.load() == {"active_slots": 1, "waiting_requests": 0}
        second = Future()
        scheduler.enqueue([one_slot.make_job(_request(max_tokens=4, n=1, seed=9), second)])
        scheduler.step()
        assert scheduler.load() == {"active_slots": 1, "waiting_requests": 1}  # blocked by the first
        assert first.cancel()
        steps = 0
        while scheduler.busy:
            scheduler.step()
            steps += 1
    assert len(second.result(timeout=0).sequences[0].tokens) == 4 and steps == 3  # admitted at the next step (its first token), 3 decodes
    assert scheduler.load() == {"active_slots": 0, "waiting_requests": 0}
    assert scheduler.stats["cancelled"] == 1 and first.cancelled()


def test_cancelling_from_the_callback_frees_the_slot_on_the_worker(one_slot):
    """As a streaming client that hangs up: the first request is cancelled mid-decode and the
    next one, queued behind it on the only slot, completes."""
    started = threading.Event()
    holder: dict[str, Future] = {}

    def hang_up(sample, tokens, logprobs) -> None:
        started.set()
        if one_slot.stats["decode_steps"] >= 2:
            holder["first"].cancel()

    holder["first"] = submit_streaming(one_slot, _request(hang_up, max_tokens=120, n=1))
    assert started.wait(120)
    second = one_slot.submit(_request(max_tokens=4, n=1, seed=9))
    assert len(second.result(timeout=120).sequences[0].tokens) == 4
    assert holder["first"].cancelled() and one_slot.stats["cancelled"] == 1
    assert one_slot.stats["decode_steps"] < 100  # the first never ran to its max_tokens
    assert one_slot.load()["active_slots"] == 0
