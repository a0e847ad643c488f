"""Qwen3.5-MoE (`src/ember/models/families/qwen3_5_moe.py`: Qwen3.5's hybrid linear/full
attention with routed experts and a gated shared expert): `ember tiny-model --family
qwen3_5_moe` loads as the family, so does a published checkpoint's layout (a vision-language
config, `model.language_model.*`, either expert layout) with equal logits; LoRA reaches every
routed expert and the shared one, trains unpacked with contract 2's gradient invariance; the
HF export loads back with the engine's logits; TorchSampler samples base, LoRA (expert
factors included) and full versions with contract 5 (abs 1e-4); vLLM is refused naming the
linear-attention layers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tinker import types
from transformers import AutoModelForCausalLM, Qwen3_5MoeConfig

from ember.cli import main
from ember.engine import EngineConfig, TorchEngine, hf_export
from ember.models import load_model, load_tokenizer, lora_target_modules
from ember.models.experts import per_expert_slot
from ember.models.families import FAMILIES, family_of, linear_attention_layers, moe_of
from ember.models.testing import target_logprobs
from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler
from helpers.datums import assert_tensors_close, random_sft_datums, sft_datum

RTOL = 1e-5
LORA = types.LoraConfig(rank=4, seed=1)
PROBE = [5, 9, 14, 22, 31, 40, 7, 3, 60, 2]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [30]]
# Gated DeltaNet's per-head decay parameters: gradients that cancel to ~1/30 of their terms,
# held to rtol 1e-5 of their layer's largest gradient (tests/models/test_models_qwen3_5.py)
DECAY = (".linear_attn.dt_bias", ".linear_attn.A_log", ".linear_attn.in_proj_a.weight")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """4 layers (linear x3, full), heads of 32, 4 experts, 2 per token, as the CLI writes it."""
    out = tmp_path_factory.mktemp("tiny-q35moe") / "m"
    assert main(["tiny-model", str(out), "--family", "qwen3_5_moe", "--layers", "4"]) == 0
    return out


@pytest.fixture(scope="module")
def vocab(moe_dir):
    return json.loads((moe_dir / "config.json").read_text())["vocab_size"]


def _engine(model_dir, budget=10_000, lora=None):
    return TorchEngine.from_pretrained(model_dir, EngineConfig(micro_batch_tokens=budget), lora_config=lora)


def _trained(model_dir, vocab, lora, steps=2, seed=4):
    engine = _engine(model_dir, lora=lora)
    for k in range(steps):
        engine.forward_backward(random_sft_datums(4, vocab=vocab, seed=seed + k), "cross_entropy")
        engine.optim_step(types.AdamParams(learning_rate=2e-2))
    return engine


def _grads(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in engine.state_tensors().items() if p.grad is not None}


def test_the_tiny_model_is_the_family_with_qwen35s_layers_and_experts(moe_dir):
    model, tok = load_model(moe_dir), load_tokenizer(moe_dir)
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM" and family_of(model.config) is FAMILIES["qwen3_5_moe"]
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"] and model.config.head_dim == 32
    assert linear_attention_layers(model.config) == [0, 1, 2] and moe_of(model.config) is FAMILIES["qwen3_moe"].moe
    experts = model.model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (4, 96, 64) and tuple(experts.down_proj.shape) == (4, 64, 48)
    assert lora_target_modules(model, LORA) == ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z",
                                                "out_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    assert len(tok.encode("<|im_end|>", add_special_tokens=False)) == 1


def _published_layout(src, dst, fused: bool):
    """`src` as a published Qwen3.5-MoE checkpoint is laid out: the vision-language config
    (`qwen3_5_moe`, its text config inside), the decoder under `model.language_model.` beside
    a vision tower and an MTP head a text-only load ignores; experts per expert (as `src`
    was saved) or fused."""
    text = json.loads((src / "config.json").read_text())
    config = Qwen3_5MoeConfig(text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64,
                                                                    num_heads=2, out_hidden_size=64))
    config.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    dst.mkdir()
    config.save_pretrained(dst)
    weights = load_model(src).state_dict() if fused else load_file(src / "model.safetensors")
    weights = {k.replace("model.", "model.language_model.", 1): v.clone() for k, v in weights.items()}
    weights["model.visual.patch_embed.proj.weight"] = torch.ones(32, 3, 2, 16, 16)
    weights["mtp.fc.weight"] = torch.ones(64, 128)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (dst / name).write_bytes((src / name).read_bytes())
    return weights


@pytest.mark.parametrize("fused", [False, True], ids=["per_expert", "fused"])
def test_a_published_checkpoints_layout_loads_with_the_same_logits(moe_dir, tmp_path, fused):
    weights = _published_layout(moe_dir, tmp_path / "published", fused)
    layout = FAMILIES["qwen3_5_moe"].moe
    assert any(per_expert_slot(n, layout) for n in weights) is not fused
    assert json.loads((tmp_path / "published" / "config.json").read_text())["model_type"] == "qwen3_5_moe"
    published, tiny = load_model(tmp_path / "published"), load_model(moe_dir)
    assert type(published).__name__ == "Qwen3_5MoeForCausalLM" and family_of(published.config) is FAMILIES["qwen3_5_moe"]
    torch.testing.assert_close(target_logprobs(published, PROBE), target_logprobs(tiny, PROBE), rtol=0, atol=0)


def test_lora_reaches_every_expert_and_training_lowers_the_loss_unpacked(moe_dir, vocab):
    engine = _engine(moe_dir, lora=LORA)
    assert engine.info().packing == "padded"
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    for part in (".mlp.experts.lora_A.", ".mlp.experts.base_layer.lora_B.", ".mlp.shared_expert.down_proj.lora_A.",
                 ".linear_attn.in_proj_qkv.lora_A."):
        assert any(part in n for n in trainable), part
    assert not any(".mlp.gate." in n or "shared_expert_gate" in n for n in trainable)  # routers stay frozen
    datums = random_sft_datums(4, vocab=vocab, seed=2)
    losses = []
    for _ in range(6):
        metrics = engine.forward_backward(datums, "cross_entropy").metrics
        losses.append(metrics["loss:sum"])
        engine.optim_step(types.AdamParams(learning_rate=1e-2))
    assert losses[-1] < 0.7 * losses[0], losses
    # the routing metrics read the family's router: 4 experts, entropy at most ln 4
    assert metrics["moe_load_imbalance:max"] >= 1.0 and 0.0 < metrics["moe_router_entropy:mean"] <= np.log(4) + 1e-6


def _assert_grads_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert_tensors_close({n: t for n, t in a.items() if not n.endswith(DECAY)},
                         {n: t for n, t in b.items() if not n.endswith(DECAY)}, rtol=RTOL)
    for name in (n for n in a if n.endswith(DECAY)):
        layer = name.split(".linear_attn.")[0] + ".linear_attn."
        scale = max(float(t.abs().max()) for n, t in b.items() if n.startswith(layer))
        torch.testing.assert_close(a[name], b[name], rtol=RTOL, atol=RTOL * scale, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("lora", [LORA, pytest.param(None, marks=pytest.mark.slow)], ids=["lora", "full"])
def test_gradient_is_invariant_to_micro_batches_and_splits(moe_dir, vocab, lora):
    datums = random_sft_datums(5, vocab=vocab, min_len=2, max_len=15, seed=1)
    ref, small = _engine(moe_dir, lora=lora), _engine(moe_dir, budget=1, lora=lora)
    ref.forward_backward(datums, "cross_entropy")
    small.forward_backward(datums[:2], "cross_entropy")
    small.forward_backward(datums[2:], "cross_entropy")
    grads = _grads(ref)
    assert any(".mlp.experts." in n for n in grads)
    _assert_grads_close(grads, _grads(small))


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_hf_export_loads_back_with_the_engines_logits(moe_dir, vocab, lora, tmp_path):
    engine = _trained(moe_dir, vocab, lora)
    engine.export_hf(tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(moe_dir if lora else tmp_path / "out", dtype=torch.float32)
    if lora is not None:
        from peft import PeftModel

        config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
        assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
        loaded = PeftModel.from_pretrained(loaded, tmp_path / "out")
    else:  # transformers' own layout: per-expert tensors
        assert any(per_expert_slot(n, moe_of(engine.hf_config)) for n, _ in hf_export.read_base_weights(tmp_path / "out"))
    ours = engine.forward([sft_datum(PROBE)], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_torch()
    torch.testing.assert_close(target_logprobs(loaded.eval(), PROBE), ours, rtol=0, atol=1e-5)


def _worst_gap(engine: TorchEngine, responses) -> float:
    """Largest |sampled logprob - engine forward logprob| over every sampled token."""
    worst = 0.0
    for p, resp in zip(PROMPTS, responses):
        assert isinstance(resp, types.SampleResponse), resp
        for seq in resp.sequences:
            ref = engine.forward([sft_datum(p + seq.tokens)], "cross_entropy").loss_fn_outputs[0]["logprobs"]
            worst = max(worst, float(np.abs(ref.to_numpy()[len(p) - 1:] - np.asarray(seq.logprobs)).max()))
    return worst


def test_torch_sampler_samples_base_lora_and_full_versions_as_the_engines_score_them(moe_dir, vocab):
    base = _engine(moe_dir)
    lora, full = _trained(moe_dir, vocab, LORA), _trained(moe_dir, vocab, None, seed=9)
    with TorchSampler.from_pretrained(moe_dir, SamplerConfig(max_slots=16)) as sampler:
        vl = sampler.load_weights(lora.named_weights(), lora_config=LORA)
        vf = sampler.load_weights(full.named_weights())
        assert vl.experts and len(vl.experts) == 2 * base.hf_config.num_hidden_layers
        requests = [SamplingRequest(prompt=types.ModelInput.from_ints(p), num_samples=2, version=v,
                                    sampling_params=types.SamplingParams(max_tokens=6, seed=i, stop=[]))
                    for v in (None, vl, vf) for i, p in enumerate(PROMPTS)]
        responses = sampler.sample_many(requests, timeout=180)
        without = sampler.load_weights({n: t for n, t in lora.named_weights() if ".mlp.experts." not in n},
                                       lora_config=LORA)
        moved = np.asarray(sampler.compute_logprobs(types.ModelInput.from_ints(PROBE), version=without)[1:])
    n = len(PROMPTS)
    for i, engine in enumerate((base, lora, full)):
        assert _worst_gap(engine, responses[n * i:n * i + n]) < 1e-4
    ref = lora.forward([sft_datum(PROBE)], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.abs(moved - ref).max() > 1e-3  # non-vacuous: the expert factors move the LoRA version


def test_the_vllm_backend_is_refused_naming_the_linear_attention_layers(moe_dir):
    from ember.sampling.base import UnsupportedModelError
    from ember.sampling.vllm_support import check_vllm_model

    for device in ("cpu", "cuda"):
        with pytest.raises(UnsupportedModelError, match=r"layer_types: linear_attention: the vLLM sampler backend"):
            check_vllm_model(moe_dir, device)


def test_estimate_counts_qwen3_5_35b_a3b_experts_k_of_e_active_and_the_shared_expert_always(tmp_path):
    """transformers' Qwen3_5MoeTextConfig defaults are Qwen3.5-35B-A3B's decoder (40 layers,
    256 experts of width 512, 8 per token, a shared expert of 512): from config.json alone,
    what is not active is exactly the 248 unchosen experts' three matrices per layer (the
    shared expert, the linear-attention layers and the rest are active), 34.7 B in all."""
    from transformers import Qwen3_5MoeTextConfig

    from ember.engine.estimate import estimate_memory

    Qwen3_5MoeTextConfig().save_pretrained(tmp_path)
    est = estimate_memory(tmp_path, tokens=4096)
    assert est.total_parameters - est.active_parameters == 40 * (256 - 8) * 3 * 2048 * 512
    assert abs(est.total_parameters / 35e9 - 1) < 0.02 and 3e9 < est.active_parameters < 3.6e9
