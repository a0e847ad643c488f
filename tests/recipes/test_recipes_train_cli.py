"""`ember train`: packaged example configs that work in any directory, and which server it uses."""

from __future__ import annotations

import fnmatch
import socket
import tomllib
from pathlib import Path

import pytest

from ember.cli import main
from ember.recipes.train_cli import EXAMPLES, RECIPES, load_recipe_config

ROOT = Path(__file__).resolve().parents[2]


def closed_port() -> int:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_config_by_recipe_name_is_the_packaged_example_in_a_fresh_directory(recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no examples/ here, as for a reader who pip-installed ember
    config = load_recipe_config(recipe, ["--config", recipe, "--steps", "3"])
    assert config.steps == 3 and config.base_model == "tiny"
    packaged = EXAMPLES / f"{recipe}.toml"
    assert (ROOT / "examples" / f"{recipe}.toml").resolve() == packaged.resolve()  # one home, linked
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    relative = packaged.relative_to(ROOT / "src" / "ember" / "recipes").as_posix()
    assert any(fnmatch.fnmatch(relative, pattern) for pattern in package_data["ember.recipes"]), package_data


def test_a_file_in_the_directory_wins_over_the_packaged_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sft").write_text('base_model = "mine"\n')
    assert load_recipe_config("sft", ["--config", "sft"]).base_model == "mine"


def test_an_unknown_config_name_says_what_is_accepted(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "sft", "--config", "sftt"]) == 2
    assert "config file not found: 'sftt' (a TOML path, or a packaged example: sft, grpo" in capsys.readouterr().err


def test_the_packaged_sft_example_names_data_made_in_code(digit_model_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from ember.recipes.sft import load_sft_data

    monkeypatch.chdir(tmp_path)
    config = load_recipe_config("sft", ["--config", "sft"])
    tok = AutoTokenizer.from_pretrained(digit_model_dir)
    examples = load_sft_data(config.data_path, tok, config.max_length, config.seed)
    assert len(examples) == 64
    prompt, completion = examples[0]
    assert tok.decode(prompt).startswith("Sum the digits of ") and completion[-1] == tok.eos_token_id


def test_ember_train_uses_TINKER_BASE_URL_and_says_so_first(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    url = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("TINKER_BASE_URL", url)
    assert main(["train", "sft", "--config", "sft", "--metrics.console", "false"]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == f"ember train sft: training on the server at {url} (from $TINKER_BASE_URL)"
    assert f"no server answers at {url}" in err  # it went there, not in process


def test_an_explicit_base_url_wins_over_the_environment(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TINKER_BASE_URL", "http://127.0.0.1:1")
    url = f"http://127.0.0.1:{closed_port()}"
    assert main(["train", "sft", "--config", "sft", "--client.base_url", url, "--metrics.console", "false"]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == f"ember train sft: training on the server at {url}"
    assert f"no server answers at {url}" in err


def test_without_a_url_ember_train_says_it_trains_in_process(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)
    monkeypatch.setenv("EMBER_DATA_DIR", str(tmp_path / "data"))
    # ./tiny-model does not exist here: the run fails after the first line, in process
    main(["train", "sft", "--config", "sft", "--metrics.console", "false"])
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (f"ember train sft: training in process (no client.base_url, no $TINKER_BASE_URL); "
                                   f"data in {tmp_path / 'data'}")


def test_ember_help_names_every_recipe(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = " ".join(capsys.readouterr().out.split())  # argparse wraps the help lines
    named = listed.split("ember train ", 1)[1].split()[0].split("|")
    assert set(named) == set(RECIPES), listed
