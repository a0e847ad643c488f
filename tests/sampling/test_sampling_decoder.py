"""The direct decoder computes the transformers forward: same logits (fp32, atol 2e-5)
through prefill and decode over the slot cache, for every supported family and option
it claims (q/k norms, biases, tied embeddings, GQA and MHA, eager masks), with full
fine-tuning versions and per-row LoRA adapters; unsupported models are refused with the
reason, or fall back under "auto"."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Qwen2Config,
    Qwen3Config,
)

from ember.sampling import SamplerConfig
from ember.sampling.kv_cache import SlotCache
from ember.sampling.runner import ModelRunner, decode_mask, prefill_inputs
from ember.sampling.weights import LoraDelta, TorchWeightVersion, parameter_aliases

ATOL = 2e-5
COMMON = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              head_dim=8, max_position_embeddings=128, bos_token_id=None, eos_token_id=None, pad_token_id=None)

CONFIGS = {
    "qwen3-gqa": lambda: Qwen3Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=False),
    "qwen3-mha-tied": lambda: Qwen3Config(**COMMON, num_key_value_heads=4, tie_word_embeddings=True),
    "llama-bias": lambda: LlamaConfig(**COMMON, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
                                      tie_word_embeddings=False),
    "qwen2": lambda: Qwen2Config(**COMMON, num_key_value_heads=1, tie_word_embeddings=True),
    "mistral-no-window": lambda: MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=None,
                                               tie_word_embeddings=False),
    # post-sublayer norms, q/k norms over the whole projection (ember.models.families.olmo2)
    "olmo2": lambda: Olmo2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=False),
}


def _model(config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random norms and biases, so a wrong formula cannot hide behind ones and zeros
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0, 0.1)
    return model


def _runners(model, attn="sdpa"):
    model.config._attn_implementation = attn
    return {f: ModelRunner(model, SlotCache(model.config.num_hidden_layers, 6, 64), attn, f)
            for f in ("direct", "transformers")}


def _run(runner, prompts, slots, full=None, lora=(), steps=3):
    """Logits of a prefill (all positions) and of `steps` greedy decode forwards."""
    cache = runner.cache
    ids, pos, valid, mask = prefill_inputs(prompts, torch.device("cpu"))
    cache.plan_prefill(slots, valid, pos)
    out = [runner.forward(ids, pos, mask, 0, full=full, lora=lora)[valid]]
    positions = torch.tensor([len(p) for p in prompts])
    nxt = torch.stack([out[0][sum(len(p) for p in prompts[: i + 1]) - 1] for i in range(len(prompts))]).argmax(-1)
    for _ in range(steps):
        kv_len = int(positions.max()) + 1
        cache.plan_decode(slots, positions, kv_len)
        logits = runner.forward(nxt[:, None], positions[:, None], decode_mask(positions, kv_len), 1, full=full,
                                lora=lora)[:, -1]
        out.append(logits)
        nxt, positions = logits.argmax(-1), positions + 1
    return out


def _assert_same(model, full=None, lora_for=None, attn="sdpa", atol=ATOL):
    runners = _runners(model, attn)
    prompts = [(3, 5, 7, 9, 11), (2, 4), (8, 1, 60, 13, 14, 15, 16), (6,)]
    slots = torch.tensor([4, 0, 2, 1])
    results = {}
    for name, runner in runners.items():
        lora = lora_for() if lora_for else ()
        results[name] = _run(runner, prompts, slots, full=full, lora=lora)
    for i, (a, b) in enumerate(zip(results["direct"], results["transformers"])):
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=0, msg=lambda m: f"forward {i}: {m}")


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_direct_matches_transformers(family):
    _assert_same(_model(CONFIGS[family]()))


def test_direct_matches_transformers_with_eager_masks():
    _assert_same(_model(CONFIGS["qwen3-gqa"]()), attn="eager")


@pytest.mark.parametrize("family", ["qwen3-gqa", "olmo2"])
def test_direct_matches_transformers_in_bfloat16(family):
    """bf16 takes the SDPA decode path and the fp32-statistics RMSNorm (as on a GPU)."""
    model = _model(CONFIGS[family]()).to(torch.bfloat16)
    _assert_same(model, atol=0.05)  # logits of magnitude ~1-4; bf16 keeps ~3 significant digits


@pytest.mark.parametrize("family", ["qwen3-mha-tied", "llama-bias", "olmo2"])
def test_direct_matches_transformers_for_a_full_version(family):
    model = _model(CONFIGS[family]())
    aliases, _, required = parameter_aliases(model)
    gen = torch.Generator().manual_seed(1)
    params = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=gen)
              for n, p in model.named_parameters() if n in required}
    _assert_same(model, full=TorchWeightVersion(0, params=params))


def test_direct_matches_transformers_with_lora_on_some_rows():
    model = _model(CONFIGS["llama-bias"]())
    gen = torch.Generator().manual_seed(2)

    def delta(module):
        lin = model.get_submodule(module)
        return LoraDelta(torch.randn(4, lin.in_features, generator=gen) * 0.1,
                         torch.randn(lin.out_features, 4, generator=gen) * 0.1, 8.0)

    adapters = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"]
    one = TorchWeightVersion(0, lora={m: delta(m) for m in adapters}, lora_rank=4)
    two = TorchWeightVersion(0, lora={m: delta(m) for m in adapters[:2]}, lora_rank=4)
    _assert_same(model, lora_for=lambda: [(torch.tensor([0, 2]), one), (torch.tensor([3]), two)])
    _assert_same(model, lora_for=lambda: [(None, one)])


def test_unsupported_models_are_refused_with_the_reason_or_fall_back():
    gpt2 = _model(GPT2Config(vocab_size=61, n_embd=32, n_layer=1, n_head=4, n_positions=64))
    windowed = _model(MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=16))
    for model, reason in ((gpt2, "model_type 'gpt2'"), (windowed, "sliding-window")):
        with pytest.raises(ValueError, match=reason):
            ModelRunner(model, SlotCache(1, 2, 16), "sdpa", "direct")
        assert ModelRunner(model, SlotCache(1, 2, 16), "sdpa", "auto").direct is None
    assert ModelRunner(_model(CONFIGS["qwen2"]()), SlotCache(2, 2, 16), "sdpa", "auto").direct is not None


def test_forward_option_is_validated():
    with pytest.raises(ValueError, match="SamplerConfig.forward must be one of"):
        SamplerConfig(forward="fast")
