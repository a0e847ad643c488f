import pytest
import torch
from tinker import types

from ember.models import apply_lora, load_model, load_tokenizer
from ember.models.testing import build_tokenizer


def test_tiny_model_loads_through_from_pretrained(tiny_model_dir):
    model = load_model(tiny_model_dir)
    tok = load_tokenizer(tiny_model_dir)
    assert model.config.model_type == "qwen3"
    assert model.config.head_dim == 16
    assert model.config.vocab_size == len(tok)
    ids = tok.encode("Sum the digits of 40913: 17")
    assert tok.decode(ids) == "Sum the digits of 40913: 17"
    assert tok.eos_token_id is not None and tok.pad_token_id is not None
    out = model(torch.tensor([ids])).logits
    assert out.shape == (1, len(ids), len(tok))


def test_llama_family(tiny_llama_dir):
    model = load_model(tiny_llama_dir)
    assert model.config.model_type == "llama"


def test_chat_template_ends_turns_with_eos(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|user|>hi<|eos|><|assistant|>"


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="local directories only"):
        load_model(tmp_path / "nope")


def test_lora_targets_and_zero_init(tiny_model_dir):
    model = load_model(tiny_model_dir)
    ids = torch.tensor([[5, 6, 7, 8]])
    before = model(ids).logits.detach().clone()
    peft_model = apply_lora(model, types.LoraConfig(rank=4, seed=3, train_mlp=False, train_unembed=True))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert any("lm_head" in n for n in trainable)
    assert not any("mlp" in n for n in trainable)
    torch.testing.assert_close(peft_model(ids).logits, before, rtol=0, atol=0)


def test_lora_seed_is_deterministic(tiny_model_dir):
    a = apply_lora(load_model(tiny_model_dir), types.LoraConfig(rank=2, seed=7))
    b = apply_lora(load_model(tiny_model_dir), types.LoraConfig(rank=2, seed=7))
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


def test_lora_selecting_nothing_is_an_error(tiny_model_dir):
    with pytest.raises(ValueError, match="selects no module"):
        apply_lora(load_model(tiny_model_dir), types.LoraConfig(rank=2, train_attn=False, train_mlp=False, train_unembed=False))


def test_tokenizer_with_merges(tmp_path):
    tok = build_tokenizer(tmp_path, corpus=["hello hello world"] * 20, vocab_size=60)
    assert tok.decode(tok.encode("hello world")) == "hello world"
