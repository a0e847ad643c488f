"""TorchSampler's prompt scoring from hidden states (`ember.sampling.prompt_logits`): with
`logprob_chunk_tokens` > 0 the prefill of a scored prompt returns its last hidden states and
the LM head runs chunk by chunk, never over the whole (P, V); `compute_logprobs`, top-k
prompt logprobs and `target_prompt_logprobs` equal the unchunked path's (fp32, rtol 1e-5),
on the base weights, a LoRA version with an adapter on lm_head, and a full version, for
both forward implementations and after a prefix-cache hit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types

from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler

PROMPT = [(11 * i + 5) % 80 + 1 for i in range(45)]
CHUNK = 7  # 44 scored rows: six full chunks and a partial one


def _versions(sampler: TorchSampler, ref_model) -> dict:
    """None (base), a LoRA version touching q_proj and lm_head, a full version."""
    g = torch.Generator().manual_seed(4)
    rank, hidden, vocab = 4, ref_model.config.hidden_size, sampler.vocab_size
    q = ref_model.model.layers[0].self_attn.q_proj
    lora = {"base_model.model.lm_head.lora_A.weight": torch.randn(rank, hidden, generator=g) * 0.3,
            "base_model.model.lm_head.lora_B.weight": torch.randn(vocab, rank, generator=g) * 0.3,
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                torch.randn(rank, q.in_features, generator=g) * 0.3,
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
                torch.randn(q.out_features, rank, generator=g) * 0.3}
    full = {k: v + 0.05 * torch.randn(v.shape, generator=g) if k == "lm_head.weight" else v
            for k, v in ref_model.state_dict().items()}
    return {"base": None, "lora": sampler.load_weights(lora, lora_config=types.LoraConfig(rank=rank)),
            "full": sampler.load_weights(full)}


def _score(sampler: TorchSampler, version) -> dict[str, np.ndarray]:
    vocab = sampler.vocab_size
    targets = np.random.default_rng(2).integers(0, vocab, size=(len(PROMPT) - 1, 3)).astype(np.int64)
    request = SamplingRequest(prompt=types.ModelInput.from_ints(PROMPT), num_samples=1, version=version,
                              sampling_params=types.SamplingParams(max_tokens=3, temperature=1.0, seed=3),
                              include_prompt_logprobs=True, topk_prompt_logprobs=5,
                              target_prompt_logprobs=types.TensorData.from_numpy(targets))
    response = sampler.submit(request).result(120)
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT), version=version)
    # the last 20 positions only: the prefix cache may serve the first 16 (one block)
    last_n = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT), version=version, prompt_logprobs_last_n=20)
    return {"compute_logprobs": np.array(logprobs[1:], np.float64),
            "last_n": np.array(last_n[-20:], np.float64),
            "prompt_logprobs": np.array(response.prompt_logprobs[1:], np.float64),
            "topk_ids": np.array([[t for t, _ in row] for row in response.topk_prompt_logprobs[1:]]),
            "topk_logprobs": np.array([[lp for _, lp in row] for row in response.topk_prompt_logprobs[1:]]),
            "targets": response.target_prompt_logprobs.to_numpy(),
            "sampled": np.array(response.sequences[0].logprobs)}


@pytest.fixture(scope="module")
def samplers(tiny_model_dir):
    made = {}
    for forward in ("direct", "transformers"):
        for chunk in (0, CHUNK):
            cfg = SamplerConfig(max_slots=4, max_len=128, forward=forward, logprob_chunk_tokens=chunk,
                                prefix_cache_tokens=64)
            made[forward, chunk] = TorchSampler.from_pretrained(tiny_model_dir, cfg)
    yield made
    for s in made.values():
        s.close()


@pytest.mark.parametrize("forward", ["direct", "transformers"])
def test_chunked_prompt_scores_equal_unchunked(samplers, ref_model, forward):
    held, chunked = samplers[forward, 0], samplers[forward, CHUNK]
    chunked_versions = _versions(chunked, ref_model)
    for name, version in _versions(held, ref_model).items():
        want = _score(held, version)
        assert held.stats["unembed_calls"] == 0, "logprob_chunk_tokens=0 keeps the forward's own logits"
        calls = chunked.stats["unembed_calls"]
        got = _score(chunked, chunked_versions[name])
        for key in ("compute_logprobs", "last_n", "prompt_logprobs", "topk_logprobs", "targets", "sampled"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=f"{name} {key}")
        np.testing.assert_array_equal(got["topk_ids"], want["topk_ids"])
        stats = chunked.stats  # the LM head never saw more than a chunk of rows
        assert stats["unembed_calls"] > calls and 0 < stats["unembed_rows_max"] <= CHUNK, stats
    assert chunked.stats["prefix_cache_hit_tokens"] > 0  # the hit's path (`Scheduler._extend`) was taken too


def test_runner_hidden_forward_then_unembed_equals_its_logits(samplers):
    """`forward(hidden=True)` + `unembed` is the forward's own logits, row by row."""
    from ember.sampling.runner import prefill_inputs

    for forward in ("direct", "transformers"):
        runner = samplers[forward, CHUNK].scheduler.runner
        ids, pos, valid, mask = prefill_inputs([tuple(PROMPT[:20]), tuple(PROMPT[:9])], torch.device("cpu"))
        slots = torch.tensor([0, 1])
        runner.cache.plan_prefill(slots, valid, pos)
        logits = runner.forward(ids, pos, mask, 0)
        runner.cache.plan_prefill(slots, valid, pos)
        hidden = runner.forward(ids, pos, mask, 0, hidden=True)
        assert hidden.shape == (*ids.shape, runner.model.config.hidden_size)
        got = torch.cat([runner.unembed(hidden[b, t : t + 3]) for b in range(2) for t in range(0, 20, 3)])
        torch.testing.assert_close(got.view(2, 20, -1)[valid], logits[valid], rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="logits_to_keep=0"):
            runner.forward(ids, pos, mask, 1, hidden=True)


def test_sampler_config_follows_the_engine_and_checks_the_value():
    from ember.engine.config import EngineConfig
    from ember.sampling import resolve_sampler_config

    assert SamplerConfig().resolved_logprob_chunk_tokens == EngineConfig().logprob_chunk_tokens
    cfg = resolve_sampler_config(SamplerConfig(), device="cpu", dtype="float32", logprob_chunk_tokens=0)
    assert cfg.resolved_logprob_chunk_tokens == 0
    mine = resolve_sampler_config(SamplerConfig(logprob_chunk_tokens=64), device="cpu", dtype="float32",
                                  logprob_chunk_tokens=0)
    assert mine.resolved_logprob_chunk_tokens == 64
    with pytest.raises(ValueError, match="SamplerConfig.logprob_chunk_tokens must be an integer >= 0"):
        SamplerConfig(logprob_chunk_tokens=-1)
