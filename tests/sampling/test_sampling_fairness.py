"""Tenants in one TorchSampler: prefix-cache hits only from the caller's own owner's
prompts, and waiting requests served round robin over owners within a slot cap
(`ember.fairness.owner_cap`), so one owner's backlog does not hold up another's request."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types

from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler
from ember.fairness import OwnerQueues
from ember.fairness import owner_cap as owner_slot_cap  # the one per-owner cap (the scheduler's slots)

PREFIX = [int(t) for t in np.random.default_rng(1).integers(1, 80, size=16)]
SUFFIX = [int(t) for t in np.random.default_rng(2).integers(1, 80, size=40)]


def _req(owner: str, tokens, n=1, max_tokens=4) -> SamplingRequest:
    return SamplingRequest(prompt=types.ModelInput.from_ints(tokens), num_samples=n, owner=owner,
                           sampling_params=types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1, stop=[]))


@pytest.fixture(scope="module")
def sampler(tiny_model_dir):
    cfg = SamplerConfig(max_slots=16, prefix_cache_tokens=1024, prefix_cache_block=16)
    with TorchSampler.from_pretrained(tiny_model_dir, cfg) as s:
        yield s


def test_cache_hits_only_the_owners_own_prompts(sampler):
    secret = PREFIX + [7] + SUFFIX  # 57 tokens: 48 cacheable
    assert sampler.submit(_req("a", secret)).result().prompt_cache_hit_tokens == 0
    sampler.submit(_req("b", PREFIX + [83] + SUFFIX)).result()  # b's own warm-up: its own prefix block
    hits = [sampler.submit(_req("b", PREFIX + [guess] + SUFFIX)).result().prompt_cache_hit_tokens
            for guess in range(10)]
    assert hits == [16] * 10  # the same for every guess, a's 7 included
    assert sampler.submit(_req("a", secret)).result().prompt_cache_hit_tokens == 48  # a's own repeat hits
    assert sampler.prefix_cache.owner_tokens("a") > 0 and sampler.prefix_cache.owner_tokens("b") > 0


def test_a_light_owner_is_served_before_a_heavy_backlog(sampler):
    heavy = [sampler.submit(_req("b", PREFIX, n=32, max_tokens=40)) for _ in range(4)]
    light = sampler.submit(_req("a", SUFFIX, n=1, max_tokens=4))
    light.result(timeout=120)
    assert not heavy[0].done()  # b's first request is still running when a's is answered
    for fut in heavy:
        assert len(fut.result(timeout=300).sequences) == 32


def test_owner_slot_cap_keeps_a_slot_free():
    assert [owner_slot_cap(n) for n in (1, 8, 15, 16, 64)] == [1, 8, 15, 15, 60]


def test_owner_queues_round_robin():
    class Job:
        def __init__(self, owner):
            self.owner = owner

    class Req:
        def __init__(self, owner, name):
            self.job, self.name = Job(owner), name

    q = OwnerQueues()
    q.extend([Req("b", "b1"), Req("b", "b2"), Req("b", "b3"), Req("a", "a1")])
    served = []
    while q:
        served.append(q.head().name)
        q.next_turn(done=True)
    assert served == ["b1", "a1", "b2", "b3"]
    q.extend([Req("a", "a1"), Req("b", "b1")])
    q.remove_if(lambda r: r.name == "a1")
    assert len(q) == 1 and q.owners() == ["b"]
