"""TorchSampler on a hybrid model (Qwen3.5: Gated DeltaNet linear-attention layers beside
full attention): each slot keeps the linear layers' recurrent state (convolution columns and
delta-rule matrix) beside the attention layers' KV (`ember.sampling.kv_cache.RecurrentSlotLayer`),
through continuous batching (slots refilled, samples placed in later steps from a snapshot,
sequences moved down as the batch drains, rows of different weights in one step). Contract 5:
sampled logprobs equal the engine's forward within 1e-4 (fp32 CPU) for the base model, a
full fine-tune and a LoRA adapter, prompts of different lengths in one batch. The prefix
cache is off for such a model."""

from __future__ import annotations

import json

import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.models import load_model
from ember.models.testing import build_tiny_model
from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler
from helpers.datums import random_sft_datums, sft_datum

LORA = types.LoraConfig(rank=4, seed=1)
KINDS = {"base": None, "full": None, "lora": LORA}
# different lengths, one longer than the delta rule's 64-token chunk
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [30], [(7 * i) % 200 + 3 for i in range(70)]]


@pytest.fixture(scope="module")
def q35_dir(tmp_path_factory):
    """The pad token's embedding is made nonzero (a real checkpoint's is; the tiny model's
    starts at zero), so left pads in a prefill would build up state unless masked."""
    out = build_tiny_model(tmp_path_factory.mktemp("tiny-q35"), family="qwen3_5", seed=0, tokenizer="bytes",
                           num_layers=4, num_heads=2, num_kv_heads=2, head_dim=32)
    model = load_model(out)
    with torch.no_grad():
        model.get_input_embeddings().weight[model.config.pad_token_id].normal_(generator=torch.Generator().manual_seed(0))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def engines(q35_dir):
    """The base model's engine, and full and LoRA engines two optimizer steps away from it."""
    vocab = json.loads((q35_dir / "config.json").read_text())["vocab_size"]
    datums = random_sft_datums(4, vocab=vocab, seed=4)
    out = {}
    for name, lora in KINDS.items():
        e = TorchEngine.from_pretrained(q35_dir, EngineConfig(), lora_config=lora)
        for _ in range(0 if name == "base" else 2):
            e.forward_backward(datums, "cross_entropy")
            e.optim_step(types.AdamParams(learning_rate=1e-2))
        out[name] = e
    return out


MAX_TOKENS = [3, 6, 4, 12]  # sequences end at different steps: the batch drains unevenly


def _requests(version, seed=0):
    return [SamplingRequest(prompt=types.ModelInput.from_ints(p), num_samples=2, version=version,
                            sampling_params=types.SamplingParams(max_tokens=n, seed=seed + i, temperature=1.0))
            for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS))]


def _worst_gap(engine: TorchEngine, responses) -> float:
    """Largest |sampled logprob - engine forward logprob| over every sampled token."""
    worst = 0.0
    for p, resp in zip(PROMPTS, responses):
        assert not isinstance(resp, Exception), resp
        for seq in resp.sequences:
            assert seq.tokens, "no token sampled"
            out = engine.forward([sft_datum(p + seq.tokens)], "cross_entropy")
            ref = out.loss_fn_outputs[0]["logprobs"].to_torch()[len(p) - 1:]
            worst = max(worst, float((torch.tensor(seq.logprobs) - ref).abs().max()))
    return worst


def _version(sampler, engines, kind):
    if kind == "base":
        return None
    return sampler.load_weights(engines[kind].named_weights(), lora_config=KINDS[kind])


# `make test-fast` runs the LoRA variant (and the mixed batch below); base and full: `make test`.
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k != "lora" else k for k in KINDS])
def test_sampled_logprobs_equal_the_engines_forward(q35_dir, engines, kind):
    """8 sequences on 3 slots: slots are refilled, later samples restore the prompt's state
    from a snapshot, and the batch compacts as it drains."""
    with TorchSampler.from_pretrained(q35_dir, SamplerConfig(max_slots=3, max_len=128)) as s:
        responses = s.sample_many(_requests(_version(s, engines, kind)), timeout=300)
        assert _worst_gap(engines[kind], responses) < 1e-4
        assert s.stats["moves"] > 0 and s.stats["sequences"] == 8, s.stats


def test_rows_of_different_weights_share_decode_steps(q35_dir, engines):
    """Base, full and LoRA requests in one batch: the full version's rows are a gathered
    subset of the slots, whose states are read and written back by index."""
    with TorchSampler.from_pretrained(q35_dir, SamplerConfig(max_slots=16, max_len=128)) as s:
        batches = {kind: _requests(_version(s, engines, kind), seed=10 * i) for i, kind in enumerate(KINDS)}
        responses = s.sample_many([r for kind in KINDS for r in batches[kind]], timeout=300)
        n = len(PROMPTS)
        for i, kind in enumerate(KINDS):
            assert _worst_gap(engines[kind], responses[i * n:(i + 1) * n]) < 1e-4, kind


@pytest.mark.parametrize("chunk", [0, 16], ids=["logits", "hidden-chunks"])
def test_prompt_logprobs_equal_the_engines_forward(q35_dir, engines, chunk):
    """Scored prompts of different lengths prefilled in one left-padded batch (the short
    ones' pads must leave the linear layers' state untouched), with the whole-prompt logits
    or the last hidden states scored in chunks (`logprob_chunk_tokens`)."""
    config = SamplerConfig(max_slots=8, max_len=128, logprob_chunk_tokens=chunk)
    with TorchSampler.from_pretrained(q35_dir, config) as s:
        requests = [SamplingRequest(prompt=types.ModelInput.from_ints(p), num_samples=1, include_prompt_logprobs=True,
                                    sampling_params=types.SamplingParams(max_tokens=1)) for p in PROMPTS]
        for p, resp in zip(PROMPTS, s.sample_many(requests, timeout=300)):
            assert not isinstance(resp, Exception), resp
            if len(p) < 2:
                continue
            ref = engines["base"].forward([sft_datum(p)], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_torch()
            torch.testing.assert_close(torch.tensor(resp.prompt_logprobs[1:]), ref, rtol=0, atol=1e-4)


def test_the_prefix_cache_is_off_and_a_repeated_prompt_scores_the_same(q35_dir):
    with TorchSampler.from_pretrained(q35_dir, SamplerConfig(max_slots=4, max_len=128,
                                                             prefix_cache_tokens=4096)) as s:
        assert not s.prefix_cache.enabled
        params = types.SamplingParams(max_tokens=4, seed=3, temperature=1.0)
        prompt = types.ModelInput.from_ints(PROMPTS[3])
        first, second = (s.sample(prompt, 1, params).sequences[0] for _ in range(2))
        assert first.tokens == second.tokens and first.logprobs == pytest.approx(second.logprobs, abs=1e-6)
        assert s.stats["prefix_cache_hit_tokens"] == 0
        assert s.kv_cache_bytes > 0


def test_a_colocated_sleep_frees_the_recurrent_state_and_sampling_resumes_the_same(q35_dir):
    params = types.SamplingParams(max_tokens=4, seed=5, temperature=1.0)
    prompt = types.ModelInput.from_ints(PROMPTS[0])
    with TorchSampler.from_pretrained(q35_dir, SamplerConfig(max_slots=4, max_len=128, colocate=True)) as s:
        before = s.sample(prompt, 2, params).sequences
        s.sleep()
        assert s.asleep and s.kv_cache_bytes == 0
        after = s.sample(prompt, 2, params).sequences
        assert [q.tokens for q in after] == [q.tokens for q in before]
        for a, b in zip(after, before):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)


def test_a_sliding_window_model_is_still_refused(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=16, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match=r"TorchSampler serves full-attention and linear-attention layers; this "
                                         r"model has layer types \['full_attention', 'sliding_attention'\]"):
        TorchSampler(Qwen3ForCausalLM(config))


def test_the_vllm_backend_refuses_it_with_the_measured_reason(q35_dir):
    """Measured with vLLM 0.32 on CPU: vLLM fails to inspect Qwen3_5ForCausalLM (its Qwen3.5
    module imports transformers' torchvision image processor); refused before any engine starts,
    on every device, naming the torch backend that serves it."""
    from ember.sampling.base import UnsupportedModelError
    from ember.sampling.vllm_support import check_vllm_model

    for device in ("cpu", "cuda"):
        with pytest.raises(UnsupportedModelError, match=r"layer_types: linear_attention: the vLLM sampler backend "
                                                        r"does not serve .*torchvision.*--sampler.backend torch"):
            check_vllm_model(q35_dir, device)
