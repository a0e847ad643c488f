"""`ember tiny-model DIR`: writes a model transformers loads; refuses what it cannot write."""

from __future__ import annotations

import pytest

from ember.cli import main


def test_writes_a_loadable_model(tmp_path, capsys):
    from ember.models import load_model, load_tokenizer

    assert main(["tiny-model", str(tmp_path / "m"), "--hidden-size", "32", "--layers", "1"]) == 0
    model, tok = load_model(tmp_path / "m"), load_tokenizer(tmp_path / "m")
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 1
    assert model.config.vocab_size == len(tok) and tok.chat_template
    assert "wrote a random-weight qwen3" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--hidden-size", "30"], "--hidden-size must be a multiple of 4"),
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
