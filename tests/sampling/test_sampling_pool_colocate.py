"""Colocation (`SamplerConfig.colocate`) through a pool: `SamplerPool.sleep` (what the
service calls before every training op) reaches every replica, local and Ray; each
replica's backend releases its memory, reports it (`debug_state()["sleep"]`), wakes on its
next request, and samples after waking equal the trainer's forward (contract 5, fp32,
abs 1e-4). TorchSampler's own sleep: what it frees, that it waits for the requests in
progress and holds new ones until it has slept, and that without `colocate` it does nothing.

On CPU the sleep frees TorchSampler's KV and prefix caches (nothing is shared with a
trainer there; the service refuses colocate without CUDA); the same calls put a vLLM
replica to sleep on a GPU (tests/service/test_service_colocate.py, GPU-marked).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler
from ember.sampling.router import HashRing
from helpers.datums import random_sft_datums, sft_datum
from helpers.server import wait_until

PROMPTS = [[5, 6, 7, 8, 9], [12, 13, 14]]
LONG_PROMPT = list(range(5, 25))  # past one prefix-cache block (16): its prefix is cached
TOL = 1e-4
START_S = 300.0  # replicas import torch and load the model: slow on a loaded 2-core machine
# no device: colocate refuses an explicit "cpu" (the service's rule), a CPU-only machine resolves to it
COLOCATED = dict(colocate=True, dtype="float32", max_slots=8, max_len=128, replica_timeout_s=120.0)


def request(tokens, seed: int, max_tokens: int = 5, version=None, session: str | None = None) -> SamplingRequest:
    params = types.SamplingParams(max_tokens=max_tokens, seed=seed, stop=[])
    return SamplingRequest(prompt=types.ModelInput.from_ints(tokens), num_samples=2, version=version,
                           session=session, sampling_params=params)


def worst_vs_forward(engine, prompts_and_responses) -> float:
    """Largest |sampled logprob - the trainer's forward logprob| over every sampled token."""
    datums, cuts, sampled = [], [], []
    for tokens, response in prompts_and_responses:
        for seq in response.sequences:
            datums.append(sft_datum(tokens + list(seq.tokens)))
            cuts.append(len(tokens) - 1)
            sampled.append(np.asarray(seq.logprobs))
    outs = engine.forward(datums, "cross_entropy").loss_fn_outputs
    return max(float(np.abs(o["logprobs"].to_numpy()[c:] - s).max()) for o, c, s in zip(outs, cuts, sampled))


@pytest.fixture(scope="module")
def trained(tiny_model_dir):
    """A LoRA trainer one Adam step away from its initialisation (fp32 CPU)."""
    lora = types.LoraConfig(rank=4, seed=3)
    engine = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(device="cpu", dtype="float32"), lora_config=lora)
    engine.forward_backward(random_sft_datums(4, 84, seed=1), "cross_entropy")
    engine.optim_step(types.AdamParams(learning_rate=2e-2))
    return engine, lora


# ---------------------------------------------------------------------- TorchSampler
@pytest.fixture(scope="module")
def colocated(tiny_model_dir):
    with TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(**COLOCATED)) as sampler:
        yield sampler


def test_sleep_frees_the_caches_and_the_next_request_wakes_it(colocated, trained):
    engine, lora = trained
    version = colocated.load_weights(engine.named_weights(), lora)
    before = colocated.sleep_stats
    first = colocated.submit(request(LONG_PROMPT, seed=1, version=version)).result(120)
    assert colocated.prefix_cache.cached_tokens() > 0 and colocated.kv_cache_bytes > 0
    colocated.sleep()
    assert colocated.sleep_stats == {**before, "asleep": True, "sleeps": before["sleeps"] + 1}
    assert colocated.prefix_cache.cached_tokens() == 0 and colocated.kv_cache_bytes == 0  # freed for the trainer
    colocated.sleep()  # already asleep: nothing more to free, not counted twice
    assert colocated.sleep_stats["sleeps"] == before["sleeps"] + 1
    again = colocated.submit(request(LONG_PROMPT, seed=1, version=version)).result(120)
    assert colocated.sleep_stats == {**before, "asleep": False, "sleeps": before["sleeps"] + 1,
                                     "wakes": before["wakes"] + 1}
    assert [s.tokens for s in again.sequences] == [s.tokens for s in first.sequences]  # same seed, same draw
    assert colocated.kv_cache_bytes > 0  # allocated again on demand
    assert worst_vs_forward(engine, [(LONG_PROMPT, first), (LONG_PROMPT, again)]) < TOL


def test_sleep_waits_for_the_requests_in_progress_and_holds_new_ones(colocated):
    slept = threading.Event()
    long = colocated.submit(request(PROMPTS[1], seed=2, max_tokens=100))
    wait_until(lambda: colocated.scheduler.busy, 60, interval=0.01, message="the long request to start")
    sleeper = threading.Thread(target=lambda: (colocated.sleep(), slept.set()))
    sleeper.start()
    held = colocated.submit(request(PROMPTS[0], seed=3))  # arrives while the sleep drains
    sleeper.join(120)
    assert slept.is_set()
    assert len(long.result(120).sequences[0].tokens) == 100  # finished, not cut short by the sleep
    assert len(held.result(120).sequences) == 2  # served after the sleep: it woke the sampler
    stats = colocated.sleep_stats
    assert not stats["asleep"] and stats["wakes"] == stats["sleeps"] >= 1


def test_closing_while_a_sleep_drains_fails_the_held_requests(tiny_model_dir):
    # a request far longer than the test lives (close cuts it short), so the sleep is still
    # draining when `held` arrives and when the sampler closes, however fast the machine
    config = SamplerConfig(**{**COLOCATED, "max_len": 4096})
    with TorchSampler.from_pretrained(tiny_model_dir, config) as sampler:
        long = sampler.submit(request(PROMPTS[1], seed=2, max_tokens=4000))
        wait_until(lambda: sampler.scheduler.busy, 60, interval=0.01, message="the long request to start")
        sleeper = threading.Thread(target=sampler.sleep)
        sleeper.start()
        wait_until(lambda: sampler.debug_state()["draining"], 60, interval=0.01, message="the sleep to drain")
        held = sampler.submit(request(PROMPTS[0], seed=3))
        assert not long.done() and not held.done()  # the state this test is about
        sampler.close()
        sleeper.join(60)
        assert not sleeper.is_alive()
        for future in (long, held):  # failed, never left waiting
            assert isinstance(future.exception(timeout=60), RuntimeError), future


def test_without_colocate_sleep_does_nothing(tiny_model_dir):
    with TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(device="cpu", max_slots=2)) as sampler:
        sampler.sample(types.ModelInput.from_ints(PROMPTS[0]), 1, types.SamplingParams(max_tokens=2, seed=1))
        sampler.sleep()
        assert sampler.sleep_stats == {"asleep": False, "sleeps": 0, "wakes": 0}


# ---------------------------------------------------------------------- a pool, local and Ray
@pytest.fixture(scope="module", params=[pytest.param("local", marks=pytest.mark.slow),
                                        pytest.param("ray", marks=pytest.mark.slow)])
def pool(request, tiny_model_dir, tmp_path_factory, ray_cluster):
    from ember.sampling.pool import SamplerPool

    if request.param == "ray":
        pytest.importorskip("ray", reason="placement 'ray' needs ray: pip install 'ember[ray]'")
        ray_cluster.start()
    cfg = SamplerConfig(replicas=2, placement=request.param, max_imbalance=64, **COLOCATED)
    pool = SamplerPool(tiny_model_dir, cfg, scratch_dir=tmp_path_factory.mktemp("pool"))
    try:
        yield pool
    finally:
        pool.close()


def sessions_on_each_replica(n: int = 2) -> list[str]:
    """Session ids whose consistent-hash home is replica 0 (n of them), then replica 1."""
    ring, homes, i = HashRing(range(2)), {0: [], 1: []}, 0
    while min(len(v) for v in homes.values()) < n:
        homes[ring.lookup(f"colocate-{i}")].append(f"colocate-{i}")
        i += 1
    return homes[0][:n] + homes[1][:n]


def sample_round(pool, version, sessions: list[str], seed: int):
    futures = pool.submit_many([request(PROMPTS[i % 2], seed=seed + i, version=version, session=s)
                                for i, s in enumerate(sessions)])
    return [(PROMPTS[i % 2], f.result(START_S)) for i, f in enumerate(futures)]


def test_pool_sleep_reaches_every_replica_and_each_wakes_to_sample_like_the_trainer(pool, trained):
    engine, lora = trained
    version = pool.load_weights(engine.named_weights(), lora)
    sessions = sessions_on_each_replica()
    served = [s["requests_total"] for s in pool.replica_stats()]
    assert worst_vs_forward(engine, sample_round(pool, version, sessions, seed=10)) < TOL
    assert all(s["requests_total"] > n for s, n in zip(pool.replica_stats(), served))  # both replicas served
    before = pool.debug_state()["sleep"]
    assert all(not b["asleep"] for b in before), before

    pool.sleep()
    slept = pool.debug_state()["sleep"]
    assert slept == [{**b, "asleep": True, "sleeps": b["sleeps"] + 1} for b in before], slept

    after = sample_round(pool, version, sessions, seed=20)  # each replica gets requests: each wakes
    woke = pool.debug_state()["sleep"]
    assert woke == [{**b, "sleeps": b["sleeps"] + 1, "wakes": b["wakes"] + 1} for b in before], woke
    assert worst_vs_forward(engine, after) < TOL
