"""Qwen3.5, the hybrid family (`src/ember/models/families/qwen3_5.py`: Gated DeltaNet
linear-attention layers and full-attention layers): a tiny random model built in code loads
through `from_pretrained`, and so does the layout of a published checkpoint (a
vision-language config and `model.language_model.*` weights); it trains (full and LoRA, on
the linear layers' projections too) without packing, with contract 2's gradient invariance
at rtol 1e-5, and its HF export loads back with the same logits; context parallelism is
refused naming the family. The sampler's side is tests/sampling/test_sampling_hybrid.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tinker import types
from transformers import AutoModelForCausalLM, Qwen3_5Config

from ember.engine import EngineConfig, TorchEngine
from ember.engine.parallel import ParallelismConfig
from ember.models import load_model, load_tokenizer, lora_target_modules
from ember.models.families import FAMILIES, family_of, linear_attention_layers
from ember.models.testing import build_tiny_model, target_logprobs
from helpers.datums import assert_tensors_close, random_rl_datums, random_sft_datums, sft_datum

RTOL = 1e-5
LORA = types.LoraConfig(rank=4, seed=1)
PROBE = [5, 9, 14, 22, 31, 40, 7, 3, 60, 2]


@pytest.fixture(scope="module")
def q35_dir(tmp_path_factory):
    """4 layers (linear, linear, linear, full: Qwen3.5's pattern), heads of 32, as
    `ember tiny-model --family qwen3_5 --layers 4` writes it."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-q35"), family="qwen3_5", seed=0, tokenizer="bytes",
                            num_layers=4, num_heads=2, num_kv_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def vocab(q35_dir):
    return json.loads((q35_dir / "config.json").read_text())["vocab_size"]


def _engine(model_dir, budget=10_000, packing=True, lora=None):
    return TorchEngine.from_pretrained(model_dir, EngineConfig(micro_batch_tokens=budget, packing=packing),
                                       lora_config=lora)


def _grads(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in engine.state_tensors().items() if p.grad is not None}


DECAY = (".linear_attn.dt_bias", ".linear_attn.A_log", ".linear_attn.in_proj_a.weight")


def assert_grads_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Contract 2 at rtol 1e-5 (`helpers.datums.assert_tensors_close`), with one measured
    exception of scale: the per-head decay parameters (a Gated DeltaNet layer's `dt_bias`,
    `A_log`, `in_proj_a`) have a gradient that is a sum over every token which cancels to
    ~1/30 of its terms (measured: |grad| 5e-5, differences up to 2.5e-9 between budgets,
    5e-5 of their own size, in fp32 through transformers' fp32 chunked kernel); they are held
    to rtol 1e-5 of the largest gradient of their layer's linear attention instead."""
    assert_tensors_close({n: t for n, t in a.items() if not n.endswith(DECAY)},
                         {n: t for n, t in b.items() if not n.endswith(DECAY)}, rtol=RTOL)
    for name in (n for n in a if n.endswith(DECAY)):
        layer = name.split(".linear_attn.")[0] + ".linear_attn."
        scale = max(float(t.abs().max()) for n, t in b.items() if n.startswith(layer))
        torch.testing.assert_close(a[name], b[name], rtol=RTOL, atol=RTOL * scale, msg=lambda m, n=name: f"{n}: {m}")


def test_the_tiny_model_has_qwen35s_layer_mix_and_loads_as_the_family(q35_dir):
    model = load_model(q35_dir)
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and family_of(model.config) is FAMILIES["qwen3_5"]
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert linear_attention_layers(model.config) == [0, 1, 2] and model.config.head_dim == 32
    assert FAMILIES["qwen3_5"].tiny_config(num_hidden_layers=2, num_attention_heads=2, head_dim=32,
                                           hidden_size=64).layer_types == ["linear_attention", "full_attention"]
    targets = lora_target_modules(model, LORA)
    assert targets == ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj",
                       "gate_proj", "up_proj", "down_proj", "lm_head"]


def test_the_cookbook_qwen3_5_renderer_finds_its_markers_as_single_tokens(q35_dir):
    renderers = pytest.importorskip("tinker_cookbook.renderers")
    tok = load_tokenizer(q35_dir)
    renderer = renderers.get_renderer("qwen3_5", tok)
    prompt = renderer.build_generation_prompt([{"role": "user", "content": "2+2?"}]).to_ints()
    text = tok.decode(prompt)
    assert text.startswith("<|im_start|>user\n2+2?<|im_end|>") and text.endswith("<|im_start|>assistant\n<think>\n")
    for marker in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert len(tok.encode(marker, add_special_tokens=False)) == 1, marker
    assert renderer.get_stop_sequences() == [tok.convert_tokens_to_ids("<|im_end|>")]


def _published_layout(src, dst):
    """`src` rewritten as a published Qwen3.5 checkpoint is laid out: the vision-language config
    (`qwen3_5`, its text config inside) and the decoder under `model.language_model.`, beside a
    vision tower and an MTP head that a text-only load leaves out."""
    text = json.loads((src / "config.json").read_text())
    config = Qwen3_5Config(text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64,
                                                                 num_heads=2, out_hidden_size=64))
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    dst.mkdir()
    config.save_pretrained(dst)
    weights = {k.replace("model.", "model.language_model.", 1): v for k, v in load_file(src / "model.safetensors").items()}
    weights["model.visual.patch_embed.proj.weight"] = torch.ones(32, 3, 2, 16, 16)
    weights["mtp.fc.weight"] = torch.ones(64, 128)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (dst / name).write_bytes((src / name).read_bytes())


def test_a_published_checkpoints_layout_loads_with_the_same_logits(q35_dir, tmp_path):
    _published_layout(q35_dir, tmp_path / "published")
    assert json.loads((tmp_path / "published" / "config.json").read_text())["model_type"] == "qwen3_5"
    published, tiny = load_model(tmp_path / "published"), load_model(q35_dir)
    assert type(published).__name__ == "Qwen3_5ForCausalLM" and family_of(published.config) is FAMILIES["qwen3_5"]
    torch.testing.assert_close(target_logprobs(published, PROBE), target_logprobs(tiny, PROBE), rtol=0, atol=0)


@pytest.mark.parametrize("lora", [None, pytest.param(LORA, marks=pytest.mark.slow)], ids=["full", "lora"])
def test_training_lowers_the_loss_and_is_not_packed(q35_dir, vocab, lora):
    engine = _engine(q35_dir, lora=lora)
    assert engine.info().packing == "padded"
    if lora is not None:  # the linear layers' projections carry adapters
        names = {n for n, p in engine.model.named_parameters() if p.requires_grad}
        assert any(".linear_attn.in_proj_qkv.lora_A." in n for n in names)
        assert any(".linear_attn.out_proj.lora_B." in n for n in names)
    datums = random_sft_datums(4, vocab=vocab, seed=2)
    losses = []
    for _ in range(6):
        losses.append(engine.forward_backward(datums, "cross_entropy").metrics["loss:sum"])
        engine.optim_step(types.AdamParams(learning_rate=1e-2))
    assert losses[-1] < 0.7 * losses[0], losses


def test_pads_after_a_sequence_do_not_change_its_outputs(q35_dir, vocab):
    """Unpacked rows are right-padded to the micro-batch's longest: a short datum's logprobs
    are the same alone and beside a long one (the recurrence and the convolution are causal)."""
    engine = _engine(q35_dir)
    short, long = [5, 9, 14, 22, 31], list(range(3, 3 + 150))  # 150 > 2 chunks of the delta rule
    alone = engine.forward([sft_datum(short)], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_torch()
    both = engine.forward([sft_datum(long), sft_datum(short)], "cross_entropy").loss_fn_outputs
    torch.testing.assert_close(both[1]["logprobs"].to_torch(), alone, rtol=0, atol=1e-6)
    alone_long = engine.forward([sft_datum(long)], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_torch()
    torch.testing.assert_close(both[0]["logprobs"].to_torch(), alone_long, rtol=0, atol=1e-6)


def test_gradient_is_invariant_to_the_micro_batch_budget(q35_dir, vocab):
    """The fast sibling of the test below: one datum per micro-batch vs all in one (LoRA)."""
    datums = random_sft_datums(4, vocab=vocab, min_len=2, max_len=15, seed=1)
    ref, small = _engine(q35_dir, lora=LORA), _engine(q35_dir, budget=1, lora=LORA)
    ref.forward_backward(datums, "cross_entropy")
    small.forward_backward(datums, "cross_entropy")
    assert_grads_close(_grads(ref), _grads(small))


@pytest.mark.slow
@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_gradient_is_invariant_to_micro_batches_packing_and_split(q35_dir, vocab, lora):
    datums = random_sft_datums(7, vocab=vocab, min_len=2, max_len=15, seed=1)
    ref = _engine(q35_dir, lora=lora)
    ref_loss = ref.forward_backward(datums, "cross_entropy").metrics["loss:sum"]
    for budget, packing in ((1, True), (9, True), (40, False)):
        e = _engine(q35_dir, budget=budget, packing=packing, lora=lora)
        assert e.forward_backward(datums, "cross_entropy").metrics["loss:sum"] == pytest.approx(ref_loss, rel=RTOL)
        assert_grads_close(_grads(ref), _grads(e))
    split = _engine(q35_dir, budget=5, lora=lora)
    split.forward_backward(datums[:3], "cross_entropy")
    split.forward_backward(datums[3:], "cross_entropy")
    assert_grads_close(_grads(ref), _grads(split))


@pytest.mark.slow
def test_rl_loss_gradient_is_invariant_too(q35_dir, vocab):
    datums = random_rl_datums(5, vocab=vocab, seed=3)
    ref, small = _engine(q35_dir, lora=LORA), _engine(q35_dir, budget=5, lora=LORA)
    ref.forward_backward(datums, "ppo")
    small.forward_backward(datums[:2], "ppo")
    small.forward_backward(datums[2:], "ppo")
    assert_grads_close(_grads(ref), _grads(small))


@pytest.mark.parametrize("lora", [None, pytest.param(LORA, marks=pytest.mark.slow)], ids=["full", "lora"])
def test_hf_export_loads_back_with_the_engines_logits(q35_dir, vocab, lora, tmp_path):
    engine = _engine(q35_dir, lora=lora)
    for _ in range(2):
        engine.forward_backward(random_sft_datums(4, vocab=vocab, seed=4), "cross_entropy")
        engine.optim_step(types.AdamParams(learning_rate=1e-2))
    engine.export_hf(tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(q35_dir if lora else tmp_path / "out", dtype=torch.float32)
    if lora is not None:
        from peft import PeftModel

        loaded = PeftModel.from_pretrained(loaded, tmp_path / "out")
    ours = engine.forward([sft_datum(PROBE)], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_torch()
    torch.testing.assert_close(target_logprobs(loaded.eval(), PROBE), ours, rtol=0, atol=1e-5)


def test_context_parallelism_is_refused_naming_the_family(q35_dir):
    with pytest.raises(ValueError, match=r"ParallelismConfig.cp=2: .* qwen3_5_text's linear-attention layers carry "
                                         r"a recurrent state .* use cp=1 for this family"):
        TorchEngine.from_pretrained(q35_dir, EngineConfig(), parallelism=ParallelismConfig(cp=2, dp_shard=1))
