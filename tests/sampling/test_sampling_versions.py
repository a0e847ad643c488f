"""Weight sync from a TorchEngine: contract 5 (sampler logprobs == engine forward
logprobs) for full fine-tuning and LoRA after several optimizer steps, immutable
snapshots (contract 4), release of old versions, mixed versions in one batch."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.engine.testing import random_sft_datums, sft_datum
from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler

from .conftest import params, prompt

PROMPTS = [[5, 6, 7, 8, 9], [12, 13, 14], [30, 31]]
ADAM = types.AdamParams(learning_rate=2e-2)


def _train(engine: TorchEngine, steps: int, seed: int) -> None:
    for k in range(steps):
        engine.forward_backward(random_sft_datums(4, 84, seed=seed + k), "cross_entropy")
        engine.optim_step(ADAM)


def _requests(version, n=2, max_tokens=8):
    return [
        SamplingRequest(prompt=prompt(p), num_samples=n, version=version, include_prompt_logprobs=True,
                        sampling_params=params(max_tokens=max_tokens, seed=10 + i, stop=[]))
        for i, p in enumerate(PROMPTS)
    ]


def _assert_matches_engine(engine: TorchEngine, responses) -> float:
    """Engine `forward` logprobs of prompt+completion == the sampler's, abs 1e-4."""
    datums, expected = [], []
    for p, resp in zip(PROMPTS, responses):
        assert isinstance(resp, types.SampleResponse), resp
        for seq in resp.sequences:
            datums.append(sft_datum(p + seq.tokens))
            expected.append(np.concatenate([resp.prompt_logprobs_np[1:], seq.logprobs_np]))
    out = engine.forward(datums, "cross_entropy")
    worst = 0.0
    for got, want in zip(out.loss_fn_outputs, expected):
        worst = max(worst, float(np.abs(got["logprobs"].to_numpy() - want).max()))
    assert worst < 1e-4, worst
    return worst


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_contract5_after_optim_steps_and_syncs(lora, tiny_model_dir):
    lora_config = types.LoraConfig(rank=4, seed=3) if lora else None
    engine = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(), lora_config=lora_config)
    with TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(max_slots=8)) as sampler:
        base = sampler.sample_many(_requests(None), timeout=60)
        history = []
        for sync in range(3):
            _train(engine, 2, seed=100 * sync)
            version = sampler.load_weights(engine.named_weights(), lora_config=lora_config)
            assert version.is_lora is lora
            responses = sampler.sample_many(_requests(version), timeout=60)
            _assert_matches_engine(engine, responses)
            history.append((version, responses))
        # Training changed the model the sampler sees (the check above is not vacuous).
        assert not np.allclose(base[0].prompt_logprobs_np[1:], history[-1][1][0].prompt_logprobs_np[1:], atol=1e-3)
        # Contract 4: every older version still samples exactly what it sampled before.
        for version, responses in history:
            again = sampler.sample_many(_requests(version), timeout=60)
            for a, b in zip(responses, again):
                assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
                assert np.allclose(a.prompt_logprobs_np[1:], b.prompt_logprobs_np[1:], atol=1e-6)


def test_old_versions_are_released(tiny_model_dir):
    engine = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig())
    with TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(max_slots=4)) as sampler:
        v1 = sampler.load_weights(engine.named_weights())
        sampler.sample_many(_requests(v1, max_tokens=3), timeout=60)
        _train(engine, 1, seed=5)
        v2 = sampler.load_weights(engine.named_weights())
        assert sampler.live_versions() == 2
        ref_version = weakref.ref(v1)
        ref_tensor = weakref.ref(next(iter(v1.params.values())))
        del v1
        gc.collect()
        assert ref_version() is None and ref_tensor() is None
        assert sampler.live_versions() == 1
        assert sampler.sample(prompt([5, 6]), 1, params(max_tokens=2), version=v2).sequences[0].tokens


def test_lora_shares_base_and_mixes_versions_in_one_batch(tiny_model_dir):
    cfg = types.LoraConfig(rank=2, seed=1, train_unembed=False)
    engine = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(), lora_config=cfg)
    full = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig())
    _train(engine, 2, seed=1)
    _train(full, 1, seed=2)
    with TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(max_slots=16)) as sampler:
        base_bytes = sum(p.numel() * p.element_size() for p in sampler.model.parameters())
        la = sampler.load_weights(engine.named_weights(), lora_config=cfg)
        _train(engine, 1, seed=9)
        lb = sampler.load_weights(engine.named_weights(), lora_config=cfg)
        fv = sampler.load_weights(full.named_weights())
        assert la.nbytes() < base_bytes / 5  # adapters only, the base is shared
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


def test_load_weights_rejects_bad_names_and_shapes(sampler):
    sd = {k: v.clone() for k, v in sampler.model.state_dict().items()}
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
