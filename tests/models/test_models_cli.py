"""`ember tiny-model DIR`: writes a model transformers loads; refuses what it cannot write."""

from __future__ import annotations

import json

import pytest

from ember.cli import main


def test_writes_a_loadable_model(tmp_path, capsys):
    from ember.models import load_model, load_tokenizer

    assert main(["tiny-model", str(tmp_path / "m"), "--hidden-size", "32", "--layers", "1"]) == 0
    model, tok = load_model(tmp_path / "m"), load_tokenizer(tmp_path / "m")
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 1
    assert model.config.vocab_size == len(tok) and tok.chat_template
    assert "wrote a random-weight qwen3" in capsys.readouterr().out


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    """`ember tiny-model DIR` with every default: what a newcomer gets."""
    out = tmp_path_factory.mktemp("tiny") / "m"
    assert main(["tiny-model", str(out)]) == 0
    return out


def test_defaults_every_backend_serves(default_model):
    """head_dim 32 (vLLM's CPU attention serves 32, 64, 80, ...; 16 it does not) and 4096
    positions (a cookbook game prompt is over 1024 tokens)."""
    config = json.loads((default_model / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == config["head_dim"] == 32
    assert config["max_position_embeddings"] == 4096


def test_max_positions_and_heads_flags(tmp_path):
    assert main(["tiny-model", str(tmp_path / "m"), "--max-positions", "8192", "--hidden-size", "128",
                 "--heads", "2", "--family", "llama"]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["model_type"], config["max_position_embeddings"], config["num_attention_heads"],
            config["head_dim"]) == ("llama", 8192, 2, 64)


def test_the_qwen3_5_family_has_linear_and_full_attention_layers(tmp_path, capsys):
    """`--family qwen3_5` with the default 2 layers: one Gated DeltaNet layer, then one
    full-attention layer, heads of 32."""
    assert main(["tiny-model", str(tmp_path / "m"), "--family", "qwen3_5"]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["head_dim"] == config["linear_key_head_dim"] == 32
    assert config["layer_types"] == ["linear_attention", "full_attention"]
    assert "wrote a random-weight qwen3_5" in capsys.readouterr().out


TEXTS = ["\\boxed{42} <a|b>_[x]# ~`$%^&*@", "héllo 世界 🎉 \t\r\n\x00\x7f", "  two  spaces\n\nUser:"]


@pytest.mark.parametrize("text", TEXTS)
def test_the_byte_tokenizer_round_trips_any_text(default_model, text):
    from ember.models import load_tokenizer

    tok = load_tokenizer(default_model)
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_every_byte_is_a_token_and_chat_markers_are_single_tokens(default_model):
    from ember.models import load_tokenizer

    tok = load_tokenizer(default_model)
    every_byte = bytes(range(256)).decode("latin-1")  # 256 code points, 384 UTF-8 bytes
    assert tok.decode(tok.encode(every_byte, add_special_tokens=False)) == every_byte
    assert len(tok.encode("\xff", add_special_tokens=False)) == 2  # U+00FF is two bytes in UTF-8
    for marker in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|begin_of_text|>", "<|eot_id|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<think>", "</think>"):
        assert len(tok.encode(marker, add_special_tokens=False)) == 1, marker
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("renderer", ["role_colon", "qwen3", "qwen3_instruct", "llama3"])
def test_the_cookbook_renderers_accept_it(default_model, renderer):
    """tinker-cookbook's renderers need their markers as single tokens (qwen3 asserts
    `Expected single token for <|im_end|>`) and parse what they rendered back."""
    renderers = pytest.importorskip("tinker_cookbook.renderers",
                                    reason="tinker-cookbook is not installed (make test installs it)")
    from ember.models import load_tokenizer

    tok = load_tokenizer(default_model)
    r = renderers.get_renderer(renderer, tok)
    convo = [{"role": "user", "content": "What is 4 + 5? Answer in \\boxed{}."}]
    prompt = r.build_generation_prompt(convo).to_ints()
    assert "\\boxed{}" in tok.decode(prompt)
    reply = {"role_colon": " \\boxed{9}\n\nUser:", "llama3": "\\boxed{9}<|eot_id|>"}.get(
        renderer, "\\boxed{9}<|im_end|>")
    message, termination = r.parse_response(tok.encode(reply, add_special_tokens=False))
    assert termination.is_clean and renderers.get_text_content(message).strip() == "\\boxed{9}"
    if renderer == "qwen3_instruct":  # the saved chat template is ChatML, as this renderer writes it
        assert prompt == tok.encode(tok.apply_chat_template(convo, add_generation_prompt=True, tokenize=False),
                                    add_special_tokens=False)


@pytest.mark.parametrize("args, message", [
    (["--hidden-size", "30"], "--hidden-size must be a multiple of 32 (heads of 32; or give --heads), got 30"),
    (["--hidden-size", "64", "--heads", "3"], "multiple of 2 x --heads (an even head size"),
    (["--heads", "0"], "--heads must be in [1, 256]"),
    (["--max-positions", "8"], "--max-positions must be in [16, 1048576], got 8"),
    (["--max-positions", "99999999999"], "--max-positions must be in [16, 1048576]"),
    (["--hidden-size", "0"], "--hidden-size must be in [1, 4096]"),
    (["--hidden-size", "1000000"], "--hidden-size must be in [1, 4096]"),
    (["--layers", "-1"], "--layers must be in [1, 4096]"),
])
def test_hostile_sizes_are_refused_before_anything_is_built(tmp_path, capsys, args, message):
    assert main(["tiny-model", str(tmp_path / "m"), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_a_non_empty_directory_or_a_file_is_never_overwritten(tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    for target in ("full", "file"):
        assert main(["tiny-model", str(tmp_path / target)]) == 2
        assert "exists and is not an empty directory" in capsys.readouterr().err
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine" and (tmp_path / "file").read_text() == "mine"
