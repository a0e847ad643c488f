"""The Sampler ABC is enforced; faults fail only the requests they touch; the worker
thread exists only while there is work; close() refuses further work."""

from __future__ import annotations

import threading

import pytest
import torch
from tinker import types

from helpers.server import wait_until

from ember.sampling import Sampler, SamplerConfig, SamplingRequest, TorchSampler
from ember.sampling.weights import TorchWeightVersion

from .conftest import params, prompt


def test_sampler_abc_is_enforced():
    with pytest.raises(TypeError, match="abstract"):
        Sampler()

    class Partial(Sampler):
        def submit(self, request):  # the other abstract methods are missing
            raise NotImplementedError

    with pytest.raises(TypeError, match="load_weights"):
        Partial()


def _worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ember-sampler-")]


def test_fault_fails_in_flight_requests_only(tiny_model_dir):
    with TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(max_slots=4)) as s:
        # A version that passed no validation (built by hand): its forward raises.
        broken = TorchWeightVersion(s.debug_state()["sampler_id"], params={"lm_head.weight": torch.zeros(84, 63)})
        bad = s.submit(SamplingRequest(prompt=prompt([5, 6]), version=broken, sampling_params=params(max_tokens=3)))
        with pytest.raises(RuntimeError, match="sampling failed"):
            bad.result(timeout=300)
        ok = s.sample(prompt([5, 6]), 2, params(max_tokens=3, stop=[]), timeout=300)
        assert [len(q.tokens) for q in ok.sequences] == [3, 3]


def test_worker_thread_only_while_busy_and_close(tiny_model_dir):
    s = TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(max_slots=4))
    before = len(_worker_threads())
    futures = [s.submit(SamplingRequest(prompt=prompt([5 + i]), sampling_params=params(max_tokens=20, stop=[])))
               for i in range(6)]
    assert all(isinstance(f.result(timeout=300), types.SampleResponse) for f in futures)
    wait_until(lambda: len(_worker_threads()) <= before, 10, interval=0.01, message="the worker thread to end")
    assert len(_worker_threads()) == before  # idle: no thread left behind
    s.close()
    refused = s.submit(SamplingRequest(prompt=prompt([5])))
    with pytest.raises(RuntimeError, match="closed"):
        refused.result(timeout=5)


def test_concurrent_callers_and_sequence_ids(sampler):
    def request(i):
        return SamplingRequest(prompt=prompt([5 + i, 6]), num_samples=2, sequence_ids=[f"r{i}-a", f"r{i}-b"],
                               sampling_params=params(max_tokens=6, seed=i, stop=[]))

    sequential = [sampler.submit(request(i)).result(timeout=300) for i in range(8)]
    results: dict[int, types.SampleResponse] = {}

    def caller(i):
        results[i] = sampler.sample(prompt([5 + i, 6]), 2, params(max_tokens=6, seed=i, stop=[]), timeout=300)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, resp in enumerate(sequential):
        assert [s.sequence_id for s in resp.sequences] == [f"r{i}-a", f"r{i}-b"]
        assert [s.tokens for s in results[i].sequences] == [s.tokens for s in resp.sequences]


def test_sample_many_starts_all_requests_in_one_batch(tiny_model_dir):
    # submit_many enqueues every request before the worker looks: one prefill forward for
    # all prompts and aligned decoding (max_tokens decode steps in all, not more); a bad
    # request among them fails alone.
    reqs = [SamplingRequest(prompt=prompt([5 + i] * (1 + i)), num_samples=2,
                            sampling_params=params(max_tokens=6, seed=i, stop=[])) for i in range(6)]
    bad = SamplingRequest(prompt=prompt([5]), sampling_params=params(max_tokens=-1))
    with TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(max_slots=16)) as s:
        out = s.sample_many(reqs[:3] + [bad] + reqs[3:], timeout=300)
        stats = s.stats
    assert isinstance(out[3], ValueError) and "max_tokens" in str(out[3])
    assert all(len(seq.tokens) == 6 for r in out[:3] + out[4:] for seq in r.sequences)
    assert stats["prefill_forwards"] == 1 and stats["prefill_prompts"] == 6
    assert stats["decode_steps"] == 5
