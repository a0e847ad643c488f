"""ember.config: typed dataclasses from TOML + CLI overrides; errors name the key; CLI exits non-zero."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from ember.config import ConfigError, flag_names, load_config, meta, parse_overrides, settings, to_dict
from ember.engine.config import EngineConfig


@dataclass
class Inner:
    rate: float = 0.5
    tags: list[str] = field(default_factory=list)


@dataclass
class Cfg:
    name: str
    steps: int = 10
    lr: float = 1e-3
    on: bool = False
    mode: Literal["ppo", "importance_sampling"] = "ppo"
    seed: int | None = None
    out: Path = Path("runs")
    models: dict[str, str] = field(default_factory=dict)
    inner: Inner = field(default_factory=Inner)
    engine: EngineConfig = field(default_factory=EngineConfig)


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_toml_nested_tables_and_types(tmp_path):
    p = write(tmp_path, """
name = "run"
steps = 3
lr = 1          # an int is a fine float
on = true
mode = "importance_sampling"
out = "/tmp/x"
[models]
tiny = "/m/tiny"
[inner]
tags = ["a", "b"]
[engine]
micro_batch_tokens = 4096
""")
    cfg = load_config(Cfg, p)
    assert cfg == Cfg(name="run", steps=3, lr=1.0, on=True, mode="importance_sampling", out=Path("/tmp/x"),
                      models={"tiny": "/m/tiny"}, inner=Inner(tags=["a", "b"]),
                      engine=EngineConfig(micro_batch_tokens=4096))
    assert isinstance(cfg.lr, float)
    assert to_dict(cfg)["out"] == "/tmp/x"


@dataclass
class Moved:
    """A setting that moved into a table (`meta(moved=True)`)."""

    keep: int = 1
    depth: int = field(default=2, metadata=meta(section="tree", moved=True))


def test_a_moved_key_reads_from_its_table_and_from_its_older_place(tmp_path):
    assert load_config(Moved, write(tmp_path, "[tree]\ndepth = 5\n")).depth == 5
    assert load_config(Moved, write(tmp_path, "depth = 6\n")).depth == 6  # where it was before
    assert load_config(Moved, write(tmp_path, "[tree]\ndepth = 5\n"), ["--depth", "7"]).depth == 7  # CLI wins
    assert load_config(Moved, write(tmp_path, "depth = 6\n"), ["--tree.depth", "8"]).depth == 8
    with pytest.raises(ConfigError, match="'depth' and 'tree.depth' name one setting"):
        load_config(Moved, write(tmp_path, "depth = 6\n[tree]\ndepth = 5\n"))
    [setting] = [s for s in settings(Moved) if s.key == "tree.depth"]
    assert flag_names(setting) == ["--depth", "--tree.depth"]  # both flags, one destination
    with pytest.raises(ValueError, match="moved=True"):
        meta(moved=True)  # only a field in a section has an older place


def test_cli_overrides_win_and_are_parsed_by_field_type(tmp_path):
    p = write(tmp_path, 'name = "run"\n[engine]\nmicro_batch_tokens = 4096\n')
    cfg = load_config(Cfg, p, ["--engine.micro_batch_tokens", "8192", "--lr=3e-4", "--on", "yes",
                               "--seed", "none", "--inner.tags", '["x"]', "--models.big", "/m/big",
                               "--engine.packing", "false", "--mode", "importance_sampling"])
    assert cfg.engine.micro_batch_tokens == 8192 and cfg.engine.packing is False
    assert cfg.lr == 3e-4 and cfg.on is True and cfg.seed is None
    assert cfg.inner.tags == ["x"] and cfg.models == {"big": "/m/big"} and cfg.mode == "importance_sampling"
    assert load_config(Cfg, None, ["--name", "n", "--seed", "7"]).seed == 7
    assert parse_overrides(["--micro-batch", "1"]) == {"micro_batch": "1"}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--name", "n", "--engine.micro_batch_tokenz", "1"],
         r"unknown config key 'engine.micro_batch_tokenz'; valid keys in \[engine\]: micro_batch_tokens, dtype"),
        (["--name", "n", "--stepz", "1"], r"unknown config key 'stepz'; valid keys in the top level: name, steps"),
        (["--name", "n", "--steps", "ten"], r"config key 'steps' \(command line\): expected int, got str 'ten'"),
        (["--name", "n", "--on", "maybe"], r"config key 'on' \(command line\): expected bool"),
        (["--name", "n", "--mode", "dpo"], r"config key 'mode': expected one of \['ppo', 'importance_sampling'\]"),
        (["--steps", "1"], r"missing required config key 'name'"),
        (["--name", "n", "--engine.micro_batch_tokens", "0"],
         r"invalid config \[engine\]: EngineConfig.micro_batch_tokens must be >= 1, got 0"),
        (["--name", "n", "--inner.tags", "[1,"], r"config key 'inner.tags': cannot parse"),
        (["--name"], r"--name needs a value"),
        (["name=x"], r"expected a config override like --section.key VALUE"),
    ],
)
def test_override_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Cfg, None, overrides)


@pytest.mark.parametrize(
    "text, message",
    [
        ('name = "n"\nsteps = "10"\n', r"config key 'steps' \(in .*c.toml\): expected int, got str '10'"),
        ('name = "n"\nlr = true\n', r"config key 'lr' \(in .*\): expected float, got bool"),
        ('name = "n"\n[inner]\nrate = 1\nbogus = 2\n', r"unknown config key 'inner.bogus' \(in .*\); valid keys in \[inner\]: rate, tags"),
        ('name = "n"\ninner = 3\n', r"config key 'inner' \(in .*\): expected a table"),
        ('name = "n"\n[inner]\ntags = ["a", 2]\n', r"config key 'inner.tags\[1\]' \(in .*\): expected str, got int"),
        ('name = \n', r"is not valid TOML"),
    ],
)
def test_file_errors_name_the_key_and_file(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Cfg, write(tmp_path, text))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"config file not found: '.*nope.toml'"):
        load_config(Cfg, tmp_path / "nope.toml")


def test_ember_train_cli_config_errors_exit_non_zero(tmp_path, capsys):
    from ember.cli import main

    bad = write(tmp_path, 'learning_rate = "fast"\n')
    cases = [
        (["train", "sft", "--config", str(tmp_path / "missing.toml")], "config file not found"),
        (["train", "grpo", "--lr", "1e-4"], "unknown config key 'lr'; valid keys in the top level: base_model"),
        (["train", "sft", "--config", str(bad)], "config key 'learning_rate' (in"),
        (["train", "sft", "--steps", "0"], "invalid config SFTConfig"),
        (["train", "grpo", "--client.base_urll", "x"], "unknown config key 'client.base_urll'"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err, (argv, err)


@pytest.mark.slow
def test_ember_train_exit_status_in_a_real_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ember.cli", "train", "grpo", "--config", str(tmp_path / "nope.toml")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "config error: config file not found" in proc.stderr


def test_ember_train_help_lists_every_key_with_its_type_and_default(capsys):
    from ember.cli import main
    from ember.config import describe_keys
    from ember.recipes.grpo import GRPOConfig

    assert main(["train", "grpo", "--help"]) == 0
    out = capsys.readouterr().out
    for line in describe_keys(GRPOConfig):
        assert line in out
    assert "--loss_fn {importance_sampling,ppo} (default: 'importance_sampling')" in out
    assert "--client.base_url str (default: '')" in out and "--metrics.jsonl bool (default: True)" in out


def test_ember_train_against_a_server_that_is_not_running_fails_in_seconds(tmp_path, capsys):
    import socket
    import time

    from ember.cli import main

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    rc = main(["train", "sft", "--base_model", "tiny", "--data_path", str(tmp_path / "d.jsonl"),
               "--run_dir", str(tmp_path / "run"), "--client.base_url", f"http://127.0.0.1:{port}"])
    assert rc == 1 and time.monotonic() - start < 15
    assert f"no server answers at http://127.0.0.1:{port}" in capsys.readouterr().err
