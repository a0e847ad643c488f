"""Mixture-of-experts families (`qwen3_moe`, `gpt_oss`): tiny models, both expert layouts
load, expert LoRA's update (`ember.models.experts`) is peft's, and exports (adapter,
merged, per-expert or fused base) load back in transformers with equal logits."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict
from tinker import types
from transformers import AutoModelForCausalLM

from ember.cli import main
from ember.engine import hf_export
from ember.models import add_lora_adapter, load_model, load_tokenizer
from ember.models.experts import expert_delta, expert_weight_name, per_expert_slot
from ember.models.families import FAMILIES, moe_families, moe_of

PROBE = torch.tensor([[5, 9, 14, 22, 31, 40, 7, 3]])
HARMONY = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"]


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def _random_lora(model, seed: int = 1) -> None:
    """Give every LoRA B a random value (a fresh adapter's B is 0: it would change nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_moe_families_are_registered_with_their_expert_layouts(tiny_moe_dir):
    model = load_model(tiny_moe_dir)
    layout = moe_of(model.config)
    assert set(moe_families()) == {"qwen3_moe", "gpt_oss", "qwen3_5_moe"} and layout is not None
    layer = model.model.layers[0]
    weights = [layer.get_parameter(p) for p in layout.param_paths]
    assert [w.dim() for w in weights] == [3, 3] and weights[0].shape[0] == getattr(model.config, layout.num_experts)
    assert len(set(weights[0].shape[1:])) == 2 and len(set(weights[1].shape[1:])) == 2  # nothing square
    layer.get_submodule(layout.router)
    expected = "eager" if model.config.model_type == "gpt_oss" else "sdpa"
    assert model.config._attn_implementation == expected


def test_both_expert_layouts_load_with_equal_logits(tiny_moe_dir, tmp_path):
    """The tiny Qwen3-MoE is saved per expert (the hub's names); the state_dict's fused names
    written as they are load to the same model."""
    model = load_model(tiny_moe_dir)
    names = json.loads((tiny_moe_dir / "model.safetensors.index.json").read_text())["weight_map"] \
        if (tiny_moe_dir / "model.safetensors.index.json").is_file() else \
        list(dict(hf_export.read_base_weights(tiny_moe_dir)))
    per_expert = any(per_expert_slot(n, moe_of(model.config)) for n in names)
    assert per_expert is (model.config.model_type == "qwen3_moe")
    hf_export.write_full_model(tmp_path / "fused", ((n, t.clone()) for n, t in model.state_dict().items()),
                               tiny_moe_dir)
    fused = load_model(tmp_path / "fused")
    assert not any(per_expert_slot(n, moe_of(model.config)) for n, _ in hf_export.read_base_weights(tmp_path / "fused"))
    torch.testing.assert_close(_logits(fused), _logits(model), rtol=0, atol=0)


def test_expert_delta_is_peft_s_update(tiny_moe_dir):
    model = add_lora_adapter(load_model(tiny_moe_dir), "default", types.LoraConfig(rank=3))
    _random_lora(model)
    layout, n = moe_of(model.config), getattr(model.config, moe_of(model.config).num_experts)
    seen = set()
    for name, module in model.named_modules():
        if type(module).__name__ != "ParamWrapper":
            continue
        weight = expert_weight_name(name.removeprefix("base_model.model."), layout)
        assert weight is not None and weight.endswith("." + module.parameter_name)
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        ours = expert_delta(a, b, n, layout.transposed, module.scaling["default"])
        torch.testing.assert_close(ours, module.get_delta_weight("default"), rtol=1e-6, atol=1e-7)
        seen.add(module.parameter_name)
    assert seen == set(layout.params)


def _lora_model(base_dir, rank: int = 4):
    model = add_lora_adapter(load_model(base_dir), "default", types.LoraConfig(rank=rank))
    _random_lora(model)
    return model.eval()


def test_adapter_export_loads_in_peft_with_equal_logits(tiny_moe_dir, tmp_path):
    model = _lora_model(tiny_moe_dir)
    adapter = get_peft_model_state_dict(model, adapter_name="default", save_embedding_layers=False)
    hf_export.write_lora_adapter(tmp_path / "a", adapter, rank=4, alpha=32, base_model="tiny", base_dir=tiny_moe_dir)
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert "base_layer" not in config["target_modules"] and "experts" not in config["target_modules"]
    loaded = PeftModel.from_pretrained(load_model(tiny_moe_dir), tmp_path / "a").eval()
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=1e-6)


@pytest.mark.parametrize("layout", ["as_saved", "fused"])
def test_merged_export_equals_the_adapted_model(tiny_moe_dir, tmp_path, layout):
    """Expert adapters merge into the fused weights or into the hub's per-expert tensors."""
    base_dir = tiny_moe_dir
    if layout == "fused":
        base_dir = tmp_path / "fused"
        hf_export.write_full_model(base_dir, load_model(tiny_moe_dir).state_dict().items(), tiny_moe_dir)
    model = _lora_model(base_dir)
    adapter = get_peft_model_state_dict(model, adapter_name="default", save_embedding_layers=False)
    config = json.loads((base_dir / "config.json").read_text())
    merged = hf_export.merge_lora(hf_export.read_base_weights(base_dir), adapter, scale=32 / 4, config=config)
    hf_export.write_full_model(tmp_path / "m", merged, base_dir)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=1e-5)


def test_merging_expert_adapters_without_the_config_names_them(tiny_moe_dir):
    model = _lora_model(tiny_moe_dir)
    adapter = get_peft_model_state_dict(model, adapter_name="default", save_embedding_layers=False)
    with pytest.raises(ValueError, match=r"adapter modules not found in the base checkpoint: .*mlp\.experts"):
        list(hf_export.merge_lora(hf_export.read_base_weights(tiny_moe_dir), adapter, scale=8.0))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_tiny_model_cli_writes_each_moe_family(tmp_path, family):
    assert main(["tiny-model", str(tmp_path / "m"), "--family", family]) == 0
    model, tok = load_model(tmp_path / "m"), load_tokenizer(tmp_path / "m")
    assert model.config.model_type == family and model.config.head_dim == 32
    assert moe_of(model.config) is FAMILIES[family].moe
    if family == "gpt_oss":
        assert all(len(tok.encode(m, add_special_tokens=False)) == 1 for m in HARMONY)
        assert tok.eos_token == "<|return|>"
    else:
        assert len(tok.encode("<|im_end|>", add_special_tokens=False)) == 1


def test_the_cookbook_s_gpt_oss_renderer_runs_on_the_tiny_tokenizer(tmp_path):
    renderers = pytest.importorskip("tinker_cookbook.renderers")
    assert main(["tiny-model", str(tmp_path / "m"), "--family", "gpt_oss", "--layers", "1"]) == 0
    tok = load_tokenizer(tmp_path / "m")
    renderer = renderers.get_renderer("gpt_oss_no_sysprompt", tok)
    prompt = renderer.build_generation_prompt([{"role": "user", "content": "What is 2+2?"}])
    text = tok.decode(prompt.to_ints())
    assert "<|start|>user<|message|>What is 2+2?<|end|>" in text and text.endswith("<|start|>assistant")
    answer = tok.encode("<|channel|>final<|message|>4<|return|>", add_special_tokens=False)
    message, termination = renderer.parse_response(answer)
    assert termination.value == "stop_sequence" and message["content"] == [{"type": "text", "text": "4"}]
    assert renderer.get_stop_sequences() == [tok.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")]
