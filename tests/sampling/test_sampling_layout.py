"""Column-major Linear weights on CPU: same values and shapes, the same forward (to fp32
rounding), tied embedding weights left alone, and wired into the CPU sampler."""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import AutoModelForCausalLM, Qwen3Config

from ember.sampling import SamplerConfig, TorchSampler
from ember.sampling.layout import column_major_linears

COMMON = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def _model(tied: bool):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen3Config(**COMMON, tie_word_embeddings=tied), dtype=torch.float32).eval()


def _is_column_major(w: torch.Tensor) -> bool:
    return w.stride() == (1, w.shape[0])


def test_linears_become_column_major_with_the_same_forward():
    model = _model(tied=False)
    reference = copy.deepcopy(model)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert column_major_linears(model) == len(linears) == 2 * 7 + 1
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, q), name
    assert all(_is_column_major(m.weight) for m in linears)
    ids = torch.randint(0, 61, (3, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-6, rtol=0)
    assert column_major_linears(model) == 0  # idempotent


def test_tied_output_weights_keep_the_embedding_layout():
    model = _model(tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert column_major_linears(model) == 2 * 7
    assert model.lm_head.weight.is_contiguous()
    assert _is_column_major(model.model.layers[0].self_attn.q_proj.weight)


def test_cpu_sampler_stores_linears_column_major(tiny_model_dir):
    sampler = TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(max_slots=2, max_len=32))
    try:
        assert _is_column_major(sampler.model.model.layers[0].mlp.down_proj.weight)
    finally:
        sampler.close()
