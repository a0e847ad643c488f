"""`ember.models.families`: the one place that says what ember knows about each decoder family."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from ember.engine.parallel import check_tp_divisibility
from ember.models import families
from ember.models.families import FAMILIES, family_of, non_full_attention_layers, uses_sliding_window

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             vocab_size=100)


@pytest.mark.parametrize("config_cls", [LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config])
def test_every_supported_architecture_has_a_family(config_cls):
    family = family_of(config_cls(**SMALL))
    assert family is not None and family.tp_plan is not None and family.direct_decode


def test_unknown_model_type_has_no_family():
    assert family_of(dataclasses.make_dataclass("Cfg", [("model_type", str)])("gpt2")) is None
    assert family_of(object()) is None


def test_sliding_window_rules():
    assert uses_sliding_window(MistralConfig(**SMALL, sliding_window=16))  # Mistral: a set window is used
    assert not uses_sliding_window(MistralConfig(**SMALL, sliding_window=None))
    assert not uses_sliding_window(Qwen2Config(**SMALL, sliding_window=16, use_sliding_window=False))
    mixed = Qwen3Config(**SMALL, layer_types=["full_attention", "sliding_attention"])
    assert non_full_attention_layers(mixed) == ["sliding_attention"] and uses_sliding_window(mixed)
    assert non_full_attention_layers(Qwen3Config(**SMALL)) == []


def test_a_family_without_a_tp_plan_is_refused_by_tensor_parallelism(monkeypatch):
    monkeypatch.setitem(FAMILIES, "llama", dataclasses.replace(FAMILIES["llama"], tp_plan=None))
    with pytest.raises(ValueError, match=r"tensor parallelism supports \('mistral', 'qwen2', 'qwen3'\); this "
                                         r"model is 'llama'"):
        check_tp_divisibility(LlamaConfig(**SMALL), 2)
    check_tp_divisibility(Qwen3Config(**SMALL), 2)
    assert families.tp_families() == ("mistral", "qwen2", "qwen3")


@pytest.mark.parametrize("name", sorted(n for n, f in FAMILIES.items() if f.vision is None))
def test_each_family_file_builds_its_tiny_model_and_names_real_classes(name, tmp_path):
    """The family's tiny config is of its model_type; its LoRA targets and TP plan name modules
    of that model; its value-head class is a transformers token classifier of the family."""
    import transformers
    from transformers import AutoModelForCausalLM

    from ember.models.testing import tiny_config

    family = FAMILIES[name]
    config = tiny_config(name, vocab_size=50)
    assert config.model_type in (name, *family.config_types) and family_of(config) is family
    assert uses_sliding_window(config) is bool(non_full_attention_layers(config))  # Qwen3.5's linear layers
    model = AutoModelForCausalLM.from_config(config)
    suffixes = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    dense_mlp = family.lora.mlp if family.moe is None else ()  # a MoE layer's MLP is its experts
    assert set(family.lora.attn + dense_mlp + family.lora.unembed) <= suffixes
    layer = model.model.layers[0]
    assert all(layer.get_parameter(path).dim() == 3 for path in family.lora.experts)
    for path in (family.tp_plan.colwise + family.tp_plan.rowwise) if family.tp_plan else ():
        layer.get_submodule(path)
    if family.value_head_class is not None:
        cls = getattr(transformers, family.value_head_class)
        assert cls.__name__.endswith("ForTokenClassification") and cls.config_class is type(config)


def test_unknown_tiny_model_family_is_refused_naming_the_known_ones():
    from ember.models.testing import tiny_config

    with pytest.raises(ValueError, match=r"unknown tiny model family 'gpt2'; expected one of \['gpt_oss', 'llama', "
                                         r"'mistral', 'olmo2', 'qwen2', 'qwen2_5_vl', 'qwen3', 'qwen3_5', 'qwen3_5_moe', 'qwen3_moe', "
                                         r"'qwen3_vl'\]"):
        tiny_config("gpt2", vocab_size=50)
