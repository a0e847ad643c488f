"""What is particular to the vLLM backend: the refusals where vLLM cannot do something
exactly, the prefix cache, adapters released from the engine, the weight gate, and an
engine that dies mid-request (the semantic tests run on it through the `sampler` fixture)."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading

import numpy as np
import pytest
from tinker import types

from helpers.server import wait_until

from ember.engine import EngineConfig, TorchEngine
from ember.sampling import SamplerConfig, SamplingRequest
from ember.sampling.params import resolve_request
from ember.sampling.weight_gate import WeightGate

from .conftest import params, prompt

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

needs_vllm = pytest.mark.needs_vllm


@needs_vllm
def test_refusals_name_the_field(vllm_sampler, tiny_model_dir):
    bad = {
        "logprobs_mode": SamplingRequest(prompt=prompt([5, 6]), logprobs_mode="processed"),
        "temperature": SamplingRequest(prompt=prompt([5, 6]), sampling_params=params(temperature=2.5)),
    }
    good = SamplingRequest(prompt=prompt([5, 6]), sampling_params=params(max_tokens=3, seed=1, stop=[]))
    results = vllm_sampler.sample_many([good, *bad.values(), good], timeout=120)
    for field, result in zip(bad, results[1:-1]):
        assert isinstance(result, ValueError) and field in str(result), (field, result)
    assert [s.tokens for s in results[0].sequences] == [s.tokens for s in results[-1].sequences]
    engine = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(), lora_config=types.LoraConfig(rank=16))
    with pytest.raises(ValueError, match=r"LoRA rank 16 exceeds .*max_lora_rank 8"):
        vllm_sampler.load_weights(engine.named_weights(), lora_config=types.LoraConfig(rank=16))


@needs_vllm
def test_topk_above_the_engines_max_logprobs_is_refused_naming_the_field():
    # top-k counts are first clamped to the vocabulary (84 for the shared engine's model, below
    # its max_logprobs of 128), so the check is shown on a config with a lower maximum
    from ember.sampling.vllm_sampler import check_engine_limits
    spec = resolve_request(SamplingRequest(prompt=prompt([5, 6]), topk_sample_logprobs=60), vocab_size=84,
                           eos_token_ids=(), max_len=64, default_max_tokens=4, default_logprobs_mode="raw",
                           can_decode=False)
    check_engine_limits(spec, SamplerConfig(backend="vllm", max_logprobs=60))
    with pytest.raises(ValueError, match=r"topk_sample_logprobs: expected at most 50 .*got 60"):
        check_engine_limits(spec, SamplerConfig(backend="vllm", max_logprobs=50))


@needs_vllm
def test_a_sampler_without_lora_refuses_a_lora_version():
    """`enable_lora=False` (vLLM has no adapter slots then): a LoRA version is refused, naming the setting."""
    from ember.sampling.vllm_sampler import check_lora_enabled
    check_lora_enabled(SamplerConfig(backend="vllm"))
    with pytest.raises(ValueError, match="SamplerConfig.enable_lora is off"):
        check_lora_enabled(SamplerConfig(backend="vllm", enable_lora=False))


@needs_vllm
def test_prefix_cache_hits_are_reported_and_change_nothing(vllm_sampler):
    # a prompt no other test sends; vLLM's CPU backend caches whole blocks of 128 tokens
    long = np.random.default_rng(123).integers(5, 80, size=200).tolist()
    p = params(max_tokens=6, seed=4, stop=[])
    # one sample each: the samples of one request are separate requests inside vLLM, and
    # the second would already hit the first's blocks
    first = vllm_sampler.sample(prompt(long), 1, p, timeout=120)
    again = vllm_sampler.sample(prompt(long), 1, p, timeout=120)
    assert first.prompt_cache_hit_tokens == 0
    assert again.prompt_cache_hit_tokens >= 128
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    for a, b in zip(first.sequences, again.sequences):
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-5)


@needs_vllm
def test_released_lora_leaves_the_engine(vllm_sampler, tiny_model_dir):
    cfg = types.LoraConfig(rank=4, seed=2)
    engine = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(), lora_config=cfg)
    version = vllm_sampler.load_weights(engine.named_weights(), lora_config=cfg)
    vllm_sampler.sample(prompt([5, 6]), 1, params(max_tokens=2), version=version, timeout=120)
    lora_id = version.lora_id
    loaded = vllm_sampler.debug_state()["loaded_lora_ids"]
    assert lora_id in loaded
    del version
    gc.collect()
    wait_until(lambda: lora_id not in vllm_sampler.debug_state()["loaded_lora_ids"], 30,
               message=f"LoRA {lora_id} to leave the engine")


def test_weight_gate_drains_loads_and_keeps_arrival_order():
    events: list[str] = []

    async def scenario():
        gate = WeightGate("base")

        async def load(key):
            events.append(f"load {key}")
            await asyncio.sleep(0.01)

        async def run(name, key, hold):
            async with gate.hold(key, load):
                events.append(f"start {name}")
                await asyncio.sleep(hold)
                events.append(f"end {name}")

        first = asyncio.create_task(run("a", "base", 0.05))
        await asyncio.sleep(0.01)  # a is running on base
        waiting = [asyncio.create_task(run("b", "v1", 0.01)), asyncio.create_task(run("c", "base", 0.01))]
        await asyncio.gather(first, *waiting)
        return gate

    gate = asyncio.run(scenario())
    # b (v1) waits for a to drain, then v1 loads; c (base) does not overtake b, and base
    # is loaded again after b has finished.
    assert events == ["start a", "end a", "load v1", "start b", "end b", "load base", "start c", "end c"]
    assert gate.swaps == 2 and gate.active == 0


@needs_vllm
def test_engine_killed_mid_request_fails_it_and_is_rebuilt(tiny_model_dir, tmp_path):
    from ember.sampling import VLLMSampler

    cfg = SamplerConfig(backend="vllm", max_slots=4, max_len=256)
    with VLLMSampler.from_pretrained(tiny_model_dir, cfg, scratch_dir=tmp_path) as s:
        assert s.sample(prompt([5, 6]), 1, params(max_tokens=2), timeout=180).sequences
        pids = s.debug_state()["engine_pids"]
        assert pids, "no engine process found"
        for pid in pids:  # frozen first: the request cannot finish before the kill on a fast machine
            os.kill(pid, signal.SIGSTOP)
        pending = s.submit(SamplingRequest(prompt=prompt([5, 6, 7]), num_samples=4,
                                           sampling_params=params(max_tokens=240, stop=[], seed=1)))
        threading.Timer(0.3, lambda: [os.kill(pid, signal.SIGKILL) for pid in pids]).start()
        with pytest.raises(Exception) as info:
            pending.result(timeout=120)
        assert not isinstance(info.value, ValueError)  # a server fault, not the user's
        again = s.sample(prompt([5, 6]), 2, params(max_tokens=3, seed=2, stop=[]), timeout=300)
        assert [len(q.tokens) for q in again.sequences] == [3, 3]
        assert s.engine_starts == 2
    # closed: a request fails at once, it does not hang or raise in the caller
    late = s.submit(SamplingRequest(prompt=prompt([5, 6]), sampling_params=params(max_tokens=2)))
    with pytest.raises(RuntimeError, match="closed"):
        late.result(timeout=5)
