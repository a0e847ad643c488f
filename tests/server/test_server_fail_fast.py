"""`ember serve` (and `ember train`) check their settings before the heavy imports: a bad
flag, value, model registration or config path, a busy port or an unusable data directory
exits 2 with its one-line message from a process that never imported torch, tinker,
transformers, peft or SQLAlchemy.

The proof is what the child process imported (`sys.modules` after `ember.cli.main`
returned), never how long it took.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from ember.service.datadir import DataDirLock
from ember.server.config import DEFAULT_CLIENT_CONFIG, DEFAULT_DYNAMIC_CONFIG, ServerConfig, check_client_configs
from helpers.server import server_env

HEAVY = ("torch", "tinker", "transformers", "peft", "sqlalchemy", "alembic", "numpy", "fastapi", "safetensors")

# Runs `ember ARGS...` in the child, then prints its exit status and the heavy packages it imported.
CHILD = f"""
import json, sys
from ember.cli import main
rc = main(sys.argv[1:])
print(json.dumps({{"rc": rc, "heavy": sorted({{m.split(".")[0] for m in sys.modules}} & {set(HEAVY)!r})}}))
"""


def run_child(*args: str) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=300,
                          env=server_env())
    assert proc.stdout.strip(), proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def not_a_model(tmp_path):
    (tmp_path / "empty").mkdir()
    return ["--model", f"m={tmp_path / 'empty'}"]


# case -> (its flags, made in tmp_path; what the one line on stderr says)
CASES = {
    "bad-int": (lambda p: ["--sampler.max_len", "abc"], "config key 'sampler.max_len': expected int | None"),
    "sampler-check": (lambda p: ["--sampler.max_len", "1"], "SamplerConfig.max_len must be an integer >= 2"),
    "engine-dtype": (lambda p: ["--engine.dtype", "fp64"], "unknown dtype 'fp64'; expected one of"),
    "autocast-dtype": (lambda p: ["--engine.autocast_dtype", "float32"], "EngineConfig.autocast_dtype must be None"),
    "workers-runtime": (lambda p: ["--workers.runtime", "slurm"], "workers.runtime must be one of local, inline"),
    "model-root": (lambda p: ["--model-root", str(p / "nowhere")], "is not a directory"),
    "not-a-model": (not_a_model, "is not a model directory (no config.json)"),
    "config-file": (lambda p: ["--config", str(p / "nope.toml")], "config file not found"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_setting_exits_2_before_any_heavy_import(tmp_path, case):
    make_flags, message = CASES[case]
    out, stderr = run_child("serve", *make_flags(tmp_path), "--data-dir", str(tmp_path / "data"), "--port", "0")
    assert out["rc"] == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ember serve: ") and message in lines[0], stderr
    assert out["heavy"] == [], f"{case}: settings were checked after importing {out['heavy']}"
    assert not (tmp_path / "data").exists()  # nothing was started or written


def test_ember_train_with_a_missing_config_file_exits_2_before_the_recipe_is_imported(tmp_path):
    out, stderr = run_child("train", "grpo", "--config", str(tmp_path / "nope.toml"))
    assert out["rc"] == 2 and "config error: config file not found" in stderr, stderr
    assert out["heavy"] == [], out


def test_the_default_client_configs_are_valid_sdk_answers():
    """ServerConfig checks the client config against the SDK's types only when it is
    overridden (tinker imports torch); the defaults are checked here instead."""
    check_client_configs(DEFAULT_CLIENT_CONFIG, DEFAULT_DYNAMIC_CONFIG)
    assert ServerConfig().client_config == DEFAULT_CLIENT_CONFIG


def test_an_overridden_client_config_is_still_checked():
    with pytest.raises(ValueError, match="fwdbwd_max_chunk_len"):
        ServerConfig(client_config={"fwdbwd_max_chunk_len": "many"})
    assert ServerConfig(client_config={"fwdbwd_max_chunk_len": 256}).client_config["fwdbwd_max_chunk_len"] == 256


def _busy_port(tmp_path, held):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    held.append(sock)
    return ["--port", str(sock.getsockname()[1]), "--data-dir", str(tmp_path / "data")]


def _data_dir_in_use(tmp_path, held):
    lock = DataDirLock(tmp_path / "data")
    (tmp_path / "data").mkdir()
    lock.acquire()  # this process holds it, as a running server would
    held.append(lock)
    return ["--port", "0", "--data-dir", str(tmp_path / "data")]


def _file(tmp_path, held, below=""):
    (tmp_path / "a-file").write_text("not a directory")
    return ["--port", "0", "--data-dir", str(tmp_path / "a-file" / below)]


# case -> (its flags, given tmp_path and a list of what the test must hold open; the one line's words)
PLACES = {
    "busy-port": (_busy_port, "cannot listen on 127.0.0.1:"),
    "data-dir-in-use": (_data_dir_in_use, "is in use by another ember process (pid"),
    "data-dir-is-a-file": (_file, "exists and is not a directory"),
    "data-dir-below-a-file": (lambda p, h: _file(p, h, "sub"), "cannot be created: Not a directory"),
}


@pytest.mark.parametrize("case", list(PLACES))
def test_a_busy_port_or_unusable_data_dir_exits_2_before_any_heavy_import(tmp_path, tiny_model_dir, case):
    make_flags, message = PLACES[case]
    held: list = []
    try:
        out, stderr = run_child("serve", "--model", f"tiny={tiny_model_dir}", *make_flags(tmp_path, held))
    finally:
        for thing in held:
            (thing.close if isinstance(thing, socket.socket) else thing.release)()
    assert out["rc"] == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ember serve: ") and message in lines[0], stderr
    assert out["heavy"] == [], f"{case}: checked after importing {out['heavy']}"
