"""Weight sync from a TorchEngine: contract 5 (sampler logprobs == engine forward
logprobs) for full fine-tuning and LoRA after several optimizer steps, immutable
snapshots (contract 4), release of old versions, mixed versions in one batch — on every
sampler backend."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from helpers.datums import random_sft_datums, sft_datum
from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler
from ember.sampling.pool import SamplerPool

from .conftest import backend_param, params, prompt

PROMPTS = [[5, 6, 7, 8, 9], [12, 13, 14], [30, 31]]
ADAM = types.AdamParams(learning_rate=2e-2)


@pytest.fixture(params=["torch", backend_param("vllm"), backend_param("pool")])  # slow ones: see backend_param
def versioned(request, tiny_model_dir):
    """A sampler of each backend (vLLM and the 2-replica pool: the session's, whose
    start-up is too slow to repeat per test)."""
    if request.param in ("vllm", "pool"):
        yield request.getfixturevalue(f"{request.param}_sampler")
        return
    with TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(max_slots=16)) as s:
        yield s


def _storage_gone(version, sampler):
    """A check that a version's storage was freed: its tensors (TorchSampler), what the
    pool's weight transport keeps (SamplerPool), or its files (VLLMSampler)."""
    if hasattr(version, "params"):
        ref = weakref.ref(next(iter(version.params.values())))
        return lambda: ref() is None
    if isinstance(sampler, SamplerPool):
        key = version.key  # not the version: the check must not keep it alive
        assert sampler.keeps(key)
        return lambda: not sampler.keeps(key)
    path = version.path
    assert path.exists()
    return lambda: not path.exists()


def _version_bytes(version) -> int:
    if hasattr(version, "nbytes"):
        return version.nbytes()
    return sum(f.stat().st_size for f in version.path.iterdir())


def _train(engine: TorchEngine, steps: int, seed: int) -> None:
    for k in range(steps):
        engine.forward_backward(random_sft_datums(4, 84, seed=seed + k), "cross_entropy")
        engine.optim_step(ADAM)


def _requests(version, n=2, max_tokens=8):
    # No prompt logprobs here: a vLLM sampler hands those requests to its torch scorer,
    # and these must exercise the backend's own generation.
    return [
        SamplingRequest(prompt=prompt(p), num_samples=n, version=version,
                        sampling_params=params(max_tokens=max_tokens, seed=10 + i, stop=[]))
        for i, p in enumerate(PROMPTS)
    ]


def _assert_matches_engine(engine: TorchEngine, responses, sampler=None, version=None) -> float:
    """Engine `forward` logprobs == the sampler's, abs 1e-4: of every sampled token, and
    (given the sampler) of each prompt through `compute_logprobs`."""
    datums, cuts, expected = [], [], []
    for p, resp in zip(PROMPTS, responses):
        assert isinstance(resp, types.SampleResponse), resp
        for seq in resp.sequences:
            datums.append(sft_datum(p + seq.tokens))
            cuts.append(len(p) - 1)
            expected.append(np.asarray(seq.logprobs_np))
    out = engine.forward(datums, "cross_entropy")
    worst = 0.0
    for got, cut, want in zip(out.loss_fn_outputs, cuts, expected):
        worst = max(worst, float(np.abs(got["logprobs"].to_numpy()[cut:] - want).max()))
    if sampler is not None:
        prompt_out = engine.forward([sft_datum(p) for p in PROMPTS], "cross_entropy").loss_fn_outputs
        for p, got in zip(PROMPTS, prompt_out):
            scored = np.asarray(sampler.compute_logprobs(prompt(p), version=version)[1:], np.float32)
            worst = max(worst, float(np.abs(got["logprobs"].to_numpy() - scored).max()))
    assert worst < 1e-4, worst
    return worst


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_contract5_after_optim_steps_and_syncs(lora, tiny_model_dir, versioned):
    lora_config = types.LoraConfig(rank=4, seed=3) if lora else None
    engine = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(), lora_config=lora_config)
    sampler = versioned
    base = sampler.sample_many(_requests(None), timeout=60)
    history = []
    for sync in range(3):
        _train(engine, 2, seed=100 * sync)
        version = sampler.load_weights(engine.named_weights(), lora_config=lora_config)
        assert version.is_lora is lora
        responses = sampler.sample_many(_requests(version), timeout=60)
        _assert_matches_engine(engine, responses, sampler, version)
        history.append((version, responses))
    # Training changed the model the sampler sees (the check above is not vacuous).
    assert [s.tokens for s in base[0].sequences] != [s.tokens for s in history[-1][1][0].sequences]
    before = sampler.compute_logprobs(prompt(PROMPTS[0]))[1:]
    after = sampler.compute_logprobs(prompt(PROMPTS[0]), version=history[-1][0])[1:]
    assert not np.allclose(before, after, atol=1e-3)
    # Contract 4: every older version still samples exactly what it sampled before.
    for version, responses in history:
        again = sampler.sample_many(_requests(version), timeout=60)
        for a, b in zip(responses, again):
            assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
            for x, y in zip(a.sequences, b.sequences):
                assert np.allclose(x.logprobs, y.logprobs, atol=1e-5)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_torch_version_hands_its_weights_back_and_loads_again_exactly(lora, tiny_model_dir):
    """`version_weights` (what a restart writes to disk) loads back into the same values:
    the same greedy tokens and logprobs."""
    lora_config = types.LoraConfig(rank=4, seed=3) if lora else None
    engine = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(), lora_config=lora_config)
    _train(engine, 1, seed=7)
    with TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(max_slots=4)) as sampler, \
            TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(max_slots=4)) as other:
        version = sampler.load_weights(engine.named_weights(), lora_config=lora_config)
        weights = sampler.version_weights(version)
        assert other.version_weights(version) is None  # another sampler's version
        assert lora is all(".lora_" in name for name in weights)
        again = other.load_weights(weights, lora_config=lora_config)
        first = sampler.sample_many(_requests(version, n=1), timeout=60)
        second = other.sample_many(_requests(again, n=1), timeout=60)
        for a, b in zip(first, second):
            assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
            for x, y in zip(a.sequences, b.sequences):
                assert np.allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-6)


def test_old_versions_are_released(tiny_model_dir, versioned):
    engine = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig())
    sampler = versioned
    gc.collect()
    before = sampler.live_versions()
    v1 = sampler.load_weights(engine.named_weights())
    sampler.sample_many(_requests(v1, max_tokens=3), timeout=60)
    _train(engine, 1, seed=5)
    v2 = sampler.load_weights(engine.named_weights())
    assert sampler.live_versions() == before + 2
    ref_version = weakref.ref(v1)
    gone = _storage_gone(v1, sampler)
    del v1
    gc.collect()
    assert ref_version() is None and gone()
    assert sampler.live_versions() == before + 1
    assert sampler.sample(prompt([5, 6]), 1, params(max_tokens=2), version=v2).sequences[0].tokens


def test_lora_shares_base_and_mixes_versions_in_one_batch(tiny_model_dir, versioned):
    cfg = types.LoraConfig(rank=2, seed=1, train_unembed=False)
    engine = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(), lora_config=cfg)
    full = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig())
    _train(engine, 2, seed=1)
    _train(full, 1, seed=2)
    sampler = versioned
    base_bytes = (tiny_model_dir / "model.safetensors").stat().st_size
    la = sampler.load_weights(engine.named_weights(), lora_config=cfg)
    _train(engine, 1, seed=9)
    lb = sampler.load_weights(engine.named_weights(), lora_config=cfg)
    fv = sampler.load_weights(full.named_weights())
    assert _version_bytes(la) < base_bytes / 5  # adapters only, the base is shared
    versions = [None, la, lb, fv]
    reqs = [r for v in versions for r in _requests(v, n=2, max_tokens=6)]
    mixed = sampler.sample_many(reqs, timeout=60)
    alone = [sampler.sample_many(_requests(v, n=2, max_tokens=6), timeout=60) for v in versions]
    flat_alone = [r for group in alone for r in group]
    for m, a in zip(mixed, flat_alone):
        assert [s.tokens for s in m.sequences] == [s.tokens for s in a.sequences]
        for x, y in zip(m.sequences, a.sequences):
            assert np.allclose(x.logprobs, y.logprobs, atol=1e-5)
    # and each version's numbers are its engine's
    _assert_matches_engine(full, mixed[9:12])


def test_load_weights_rejects_bad_names_and_shapes(sampler, ref_model):
    sd = {k: v.clone() for k, v in ref_model.state_dict().items()}
    with pytest.raises(ValueError, match="unknown weight name 'model.nope'"):
        sampler.load_weights({**sd, "model.nope": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"missing 1 .*lm_head.weight"):
        sampler.load_weights({k: v for k, v in sd.items() if k != "lm_head.weight"})
    with pytest.raises(ValueError, match=r"lm_head.weight.*expected shape \(84, 64\), got \(84, 63\)"):
        sampler.load_weights({**sd, "lm_head.weight": torch.zeros(84, 63)})
    lora_name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    with pytest.raises(ValueError, match="pass lora_config"):
        sampler.load_weights({lora_name: torch.zeros(4, 64)})
    cfg = types.LoraConfig(rank=4)
    with pytest.raises(ValueError, match="not both A and B"):
        sampler.load_weights({lora_name: torch.zeros(4, 64)}, lora_config=cfg)
    b_name = lora_name.replace("lora_A", "lora_B")
    with pytest.raises(ValueError, match=r"rank 4"):
        sampler.load_weights({lora_name: torch.zeros(4, 64), b_name: torch.zeros(64, 3)}, lora_config=cfg)
