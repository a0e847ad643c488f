"""`ember.engine.hf_export`: sharded full-model exports load in transformers unchanged;
tied embeddings are written once; refusals name the problem."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from ember.engine import hf_export
from ember.models.testing import target_logprobs

PROBE = [5, 9, 14, 22, 31, 40, 7]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_sharded_full_export_loads_with_the_same_logprobs(tmp_path, tiny_model_dir, tied):
    base_dir = tiny_model_dir
    if tied:
        base_dir = tmp_path / "tied"
        m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, tie_word_embeddings=True)
        m.lm_head.weight = m.model.embed_tokens.weight  # one tensor, as a tied model trains it
        m.save_pretrained(base_dir)
        for name in hf_export.TOKENIZER_FILES:
            if (tiny_model_dir / name).is_file():
                (base_dir / name).write_bytes((tiny_model_dir / name).read_bytes())
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # a change the export must carry
        model.model.norm.weight.mul_(1.5)
    out = tmp_path / "out"
    hf_export.write_full_model(out, ((n, t.clone()) for n, t in model.state_dict().items()), base_dir,
                               max_shard_bytes=64 << 10)
    index = json.loads((out / hf_export.MODEL_INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((out / s).is_file() for s in shards)
    assert ("lm_head.weight" in index["weight_map"]) is not tied
    assert json.loads((out / "config.json").read_text()).get("tie_word_embeddings", False) is tied
    assert not list(out.glob(".shard-*")) and (out / "tokenizer.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    torch.testing.assert_close(target_logprobs(loaded, PROBE), target_logprobs(model, PROBE), rtol=0, atol=1e-6)


def test_refusals(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="max_shard_bytes must be >= 1, got 0"):
        hf_export.write_full_model(tmp_path / "a", iter(()), tiny_model_dir, max_shard_bytes=0)
    with pytest.raises(ValueError, match="no weights to export"):
        hf_export.write_full_model(tmp_path / "b", iter(()), tiny_model_dir)
    with pytest.raises(ValueError, match="no lora_A/lora_B tensors"):
        hf_export.write_lora_adapter(tmp_path / "c", {"x.weight": torch.zeros(2)}, rank=2, alpha=32, base_model="m")
    assert hf_export.lora_target_modules(["base_model.model.a.q_proj.lora_A.weight",
                                          "base_model.model.a.v_proj.lora_B.weight"]) == ["q_proj", "v_proj"]


def test_a_head_that_differs_from_the_tied_embedding_is_kept_and_untied(tmp_path, tiny_model_dir):
    base = tmp_path / "base"
    base.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    emb = torch.randn(8, 4)
    hf_export.write_full_model(tmp_path / "o", [("model.embed_tokens.weight", emb), ("lm_head.weight", emb + 1)], base)
    written = json.loads((tmp_path / "o" / "config.json").read_text())
    from safetensors.torch import load_file

    assert set(load_file(tmp_path / "o" / hf_export.MODEL_WEIGHTS)) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert written["tie_word_embeddings"] is False and written["torch_dtype"] == "float32"


def _adapter(module: str, out_f: int, in_f: int, r: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"base_model.model.{module}.lora_A.weight": torch.randn(r, in_f, generator=g),
            f"base_model.model.{module}.lora_B.weight": torch.randn(out_f, r, generator=g)}


def test_merge_lora_adds_the_scaled_update_and_names_what_it_cannot_place():
    w, emb = torch.randn(6, 4), torch.randn(10, 4)
    adapter = {**_adapter("model.q_proj", 6, 4), **_adapter("lm_head", 10, 4)}
    a, b = adapter["base_model.model.model.q_proj.lora_A.weight"], adapter["base_model.model.model.q_proj.lora_B.weight"]
    base = [("model.q_proj.weight", w), ("model.embed_tokens.weight", emb)]
    merged = dict(hf_export.merge_lora(iter(base), adapter, scale=0.5, tied_head=True))
    torch.testing.assert_close(merged["model.q_proj.weight"], w + 0.5 * b @ a, rtol=0, atol=1e-6)
    head_a, head_b = adapter["base_model.model.lm_head.lora_A.weight"], adapter["base_model.model.lm_head.lora_B.weight"]
    torch.testing.assert_close(merged["lm_head.weight"], emb + 0.5 * head_b @ head_a, rtol=0, atol=1e-6)
    torch.testing.assert_close(merged["model.embed_tokens.weight"], emb, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"adapter modules not found in the base checkpoint: \['lm_head'\]"):
        list(hf_export.merge_lora(iter(base), adapter, scale=0.5, tied_head=False))
    with pytest.raises(ValueError, match=r"LoRA update of shape \(6, 4\) does not fit a weight of shape \(4, 4\)"):
        list(hf_export.merge_lora(iter([("model.q_proj.weight", torch.zeros(4, 4))]), _adapter("model.q_proj", 6, 4),
                                  scale=1.0))


# ---------------------------------------------------------------- value heads (token classifiers)
def _head(hidden=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"score.weight": torch.randn(1, hidden, generator=g), "score.bias": torch.randn(1, generator=g)}


def test_token_classification_config_and_names(tmp_path, tiny_model_dir):
    from transformers import AutoModelForTokenClassification

    base_cfg = json.loads((tiny_model_dir / "config.json").read_text())
    cfg = hf_export.token_classification_config(base_cfg)
    assert cfg["architectures"] == ["Qwen3ForTokenClassification"] and base_cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["id2label"] == {"0": "VALUE"} and cfg["label2id"] == {"VALUE": 0} and cfg["ember_head"] == "value"
    for bad in ({}, {"architectures": ["BertModel"]}, {"architectures": None}):
        with pytest.raises(ValueError, match="config.json architectures must name an XForCausalLM class"):
            hf_export.token_classification_config({**base_cfg, **bad} if bad else
                                                  {k: v for k, v in base_cfg.items() if k != "architectures"})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    head = _head()
    out = tmp_path / "value"
    hf_export.write_value_model(out, ((n, t.clone()) for n, t in model.state_dict().items()), head, tiny_model_dir,
                                max_shard_bytes=64 << 10)
    index = json.loads((out / hf_export.MODEL_INDEX).read_text())
    assert "lm_head.weight" not in index["weight_map"] and {"score.weight", "score.bias"} <= set(index["weight_map"])
    assert (out / "tokenizer.json").is_file()
    loaded = AutoModelForTokenClassification.from_pretrained(out).eval()
    assert loaded.config.num_labels == 1
    torch.testing.assert_close(loaded.score.weight, head["score.weight"], rtol=0, atol=0)
    ids = torch.tensor([PROBE])
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state
        torch.testing.assert_close(loaded(input_ids=ids).logits, h @ head["score.weight"].T + head["score.bias"],
                                   rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"a value head holds score.bias and score.weight; got \['score.weight'\]"):
        hf_export.write_value_model(tmp_path / "bad", iter(()), {"score.weight": torch.zeros(1, 64)}, tiny_model_dir)
    with pytest.raises(ValueError, match=r"Linear\(hidden, 1\)"):
        hf_export.write_value_model(tmp_path / "bad", iter(()), {"score.weight": torch.zeros(2, 64),
                                                                  "score.bias": torch.zeros(2)}, tiny_model_dir)


def test_value_adapter_config(tmp_path, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForTokenClassification

    g = torch.Generator().manual_seed(1)
    adapter = {f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{ab}.weight":
               torch.randn(*((4, 64) if ab == "A" else (64, 4)), generator=g) * 0.1 for i in (0, 1) for ab in "AB"}
    head = _head(seed=2)
    out = tmp_path / "adapter"
    hf_export.write_lora_adapter(out, adapter, rank=4, alpha=32, base_model=str(tiny_model_dir),
                                 base_dir=tiny_model_dir, head=head)
    cfg = json.loads((out / hf_export.ADAPTER_CONFIG).read_text())
    assert cfg["task_type"] == "TOKEN_CLS" and cfg["modules_to_save"] == ["score"] and cfg["target_modules"] == ["q_proj"]
    import safetensors.torch

    saved = safetensors.torch.load_file(str(out / hf_export.ADAPTER_WEIGHTS))
    assert set(saved) == set(adapter) | {"base_model.model.score.weight", "base_model.model.score.bias"}
    base = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1)
    model = PeftModel.from_pretrained(base, out).eval()
    torch.testing.assert_close(model.base_model.model.score.modules_to_save["default"].weight, head["score.weight"],
                               rtol=0, atol=0)
    # no head: the causal-LM adapter as before
    hf_export.write_lora_adapter(tmp_path / "plain", adapter, rank=4, alpha=32, base_model="m")
    plain = json.loads((tmp_path / "plain" / hf_export.ADAPTER_CONFIG).read_text())
    assert plain["task_type"] == "CAUSAL_LM" and not plain.get("modules_to_save")
