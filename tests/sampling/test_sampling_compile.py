"""`SamplerConfig.compile` (`[sampler.torch] compile`): TorchSampler's decode step with its
tensor-only kernels compiled (`ember.sampling.decoder.compiled_kernels`). Compiled graphs
are counted (`debug_state()["compile"]`) over decode steps of 1..6 rows and prompt lengths
3..40 and do not grow on a second identical round; greedy tokens equal eager ones and
their logprobs agree within 1e-4 (fp32 CPU) for the base weights and two LoRA versions in
one batch. The compiled cases are slow: inductor takes ~30 s on this CPU for the graphs."""

from __future__ import annotations

import random

import pytest
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler
from helpers.datums import random_sft_datums

from .conftest import prompt

ATOL = 1e-4  # fp32 CPU, sampler-vs-sampler logprobs
# 5 kernel shapes (RMSNorm over hidden states and, for Qwen3's per-head q/k norm, over
# heads; rotary; attention core; gated activation), each compiled for one row and for
# several (torch specialises size 1); 2 graphs of slack for a stride guard
GRAPH_BOUND = 12


@pytest.fixture(scope="module")
def samplers(tiny_model_dir):
    compiled = TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(compile=True, max_len=128))
    eager = TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(max_len=128))
    yield compiled, eager
    compiled.close()
    eager.close()


def _sweep(seed: int, version=None) -> list[SamplingRequest]:
    """Rounds of 1..6 concurrent greedy requests, prompt lengths 3..40."""
    rng = random.Random(seed)
    rounds = []
    for n in range(1, 7):
        rounds.append([SamplingRequest(
            prompt=prompt(rng.randrange(5, 80) for _ in range(rng.randrange(3, 41))), num_samples=1, version=version,
            sampling_params=types.SamplingParams(max_tokens=rng.randrange(2, 8), temperature=0.0, stop=[]))
            for _ in range(n)])
    return rounds


def _graphs(sampler: TorchSampler) -> int:
    return sampler.debug_state()["compile"]["graphs"]


@pytest.mark.slow
def test_decode_graphs_are_bounded_and_do_not_grow_on_a_second_round(samplers):
    compiled, _ = samplers
    for requests in _sweep(0):
        compiled.sample_many(requests, timeout=600)
    first = compiled.debug_state()["compile"]
    assert 0 < first["graphs"] <= GRAPH_BOUND, first
    assert first["compile_seconds"] > 0 and first["compiled_layers"] == 2
    for requests in _sweep(0) + _sweep(1):  # the same round again, then other batch sizes and lengths
        compiled.sample_many(requests, timeout=600)
    assert _graphs(compiled) == first["graphs"]


@pytest.mark.slow
def test_compiled_equals_eager_for_base_and_lora_versions_in_one_batch(samplers, tiny_model_dir):
    compiled, eager = samplers
    lora_config = types.LoraConfig(rank=4, seed=3)
    engine = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(), lora_config=lora_config)
    versions = {}
    for step in range(2):  # two LoRA versions with non-zero B
        engine.forward_backward(random_sft_datums(4, 84, seed=step), "cross_entropy")
        engine.optim_step(types.AdamParams(learning_rate=5e-2))
        versions[step] = [s.load_weights(engine.named_weights(), lora_config=lora_config) for s in samplers]
    requests = {}
    for which in range(2):
        batch = [r for v in (None, versions[0][which], versions[1][which]) for r in _sweep(7, v)[3]]
        requests[which] = batch  # 4 prompts per version, 12 rows in one batch
    got = compiled.sample_many(requests[0], timeout=600)
    want = eager.sample_many(requests[1], timeout=600)
    for g, w in zip(got, want):
        assert g.sequences[0].tokens == w.sequences[0].tokens
        diff = max(abs(a - b) for a, b in zip(g.sequences[0].logprobs, w.sequences[0].logprobs))
        assert diff <= ATOL, diff
    # the LoRA deltas took effect under compile: the same prompts' first logprobs move with the version
    first = [[g.sequences[0].logprobs[0] for g in got[k:k + 4]] for k in (0, 4, 8)]
    assert max(abs(a - b) for a, b in zip(first[0], first[1])) > 1e-3
    assert max(abs(a - b) for a, b in zip(first[1], first[2])) > 1e-3


def test_compile_is_reported_before_the_first_decode_step(tiny_model_dir, tmp_path):
    sampler = TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(compile=True, compile_cache_dir=str(tmp_path)))
    try:
        state = sampler.debug_state()["compile"]
        assert state["graphs"] == 0 and state["compiled_layers"] == 0 and state["cache_dir"] == str(tmp_path)
    finally:
        sampler.close()
    plain = TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig())
    assert "compile" not in plain.debug_state()
    plain.close()


@pytest.mark.parametrize("kwargs, match", [
    (dict(forward="transformers"), "forward='transformers' is not compiled"),
    (dict(batch_invariant=True), "compile with batch_invariant"),
    (dict(backend="vllm"), "backend 'vllm' compiles its own way"),
])
def test_combinations_that_cannot_compile_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplerConfig(compile=True, **kwargs)
