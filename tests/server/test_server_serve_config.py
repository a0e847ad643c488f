"""`ember serve --config serve.toml`: one typed file for the server, engine, sampler,
workers and parallel settings, flags on top; a bad key, type or value exits 2 naming it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ember.engine.config import EngineConfig
from ember.sampling.config import SamplerConfig
from ember.server import cli
from ember.service.limits import Limits
from helpers.cli import run_cli

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serve.toml"


def _load(argv):
    return cli.load_serve_config(argv)


def test_example_file_loads_to_the_defaults_it_documents():
    config = _load(["--config", str(EXAMPLE)])
    service = config.service
    assert service.engine == EngineConfig() and service.sampler == SamplerConfig() and service.limits == Limits()
    assert config.workers.runtime == "local"
    server = config.server
    assert server.port == 8000 and list(server.api_keys) == ["tml-change-me"]


def _example_keys() -> set[str]:
    """Dotted keys the example file sets or shows commented out (`# key = ...`)."""
    keys, section = set(), ""
    for line in EXAMPLE.read_text().splitlines():
        header = re.match(r"^\[([\w.]+)\]", line)  # [sampler.torch]: a nested table
        if header:
            section = header[1] + "."
            continue
        m = re.match(r"^#?\s*([a-z_][a-z0-9_]*)\s*=", line)  # keys may hold digits (float8)
        if m:
            keys.add(section + m[1])
    return keys


def test_example_file_shows_every_setting_and_every_setting_is_documented():
    """A field added to a component's dataclass is a key of examples/serve.toml, with a doc."""
    from ember.config import settings
    from ember.server.serve_config import ServeConfig

    every = settings(ServeConfig)
    table_keys = {s.key for s in every if s.is_dict}  # [model], [client_config], ...: tables
    shown = _example_keys() | {k for k in table_keys if k.split(".")[-1] in EXAMPLE.read_text()}
    missing = [s.key for s in every if s.key not in shown and not any(a in shown for a in s.aliases)]
    assert not missing, f"examples/serve.toml lacks {missing}"
    assert not [s.key for s in every if not s.doc], "settings without a `name: text` docstring entry"
    defaults = ServeConfig()  # what the example documents is what the code defaults to
    assert _load(["--config", str(EXAMPLE)]).service.limits == defaults.service.limits


def test_repeated_flags_add_to_the_file_and_aliases_name_one_setting(tmp_path):
    cfg = tmp_path / "serve.toml"
    cfg.write_text('api_key = ["tml-a"]\n[api_keys]\n"tml-o" = "olga"\n[client_config]\nfwdbwd_max_chunk_len = 64\n')
    config = _load(["--config", str(cfg), "--api-key", "tml-b", "--api-key", "tml-c", "--api-keys", "tml-p=pia",
                    "--client-config", "parallel_fwdbwd_chunks=true", "--metrics-auth", "off"])
    server = config.server
    assert set(server.api_keys) == {"tml-a", "tml-b", "tml-c", "tml-o", "tml-p"}
    assert (server.api_keys["tml-o"], server.api_keys["tml-p"]) == ("olga", "pia")
    assert server.client_config["fwdbwd_max_chunk_len"] == 64 and server.client_config["parallel_fwdbwd_chunks"] is True
    assert server.metrics_auth is False
    cfg.write_text('[model]\na = "x"\n[models]\nb = "y"\n')
    with pytest.raises(ValueError, match="'model' and 'models' name one setting"):
        _load(["--config", str(cfg)])


def test_sampler_tables_per_backend_and_the_older_flat_keys(tmp_path):
    """`[sampler.torch]`, `[sampler.vllm]`, `[sampler.pool]` hold each backend's settings;
    the flat keys and flags they had before (`[sampler] max_loras`, `--sampler.replicas`)
    still name the same settings, the command line winning over the file either way."""
    cfg = tmp_path / "serve.toml"
    cfg.write_text('[sampler]\nbackend = "torch"\nmax_loras = 3\nplacement = "local"\n'
                   '[sampler.torch]\nprefix_cache_tokens = 0\n[sampler.vllm]\nkv_cache_gb = 2.0\n'
                   '[sampler.pool]\nmax_imbalance = 2\n')
    sampler = _load(["--config", str(cfg)]).service.sampler
    assert (sampler.max_loras, sampler.prefix_cache_tokens, sampler.kv_cache_gb, sampler.max_imbalance) == (3, 0, 2.0, 2)
    sampler = _load(["--config", str(cfg), "--sampler.replicas", "2", "--sampler.pool.max_imbalance", "5",
                     "--sampler.vllm.max_loras", "6", "--sampler.prefix_cache_tokens", "64"]).service.sampler
    assert (sampler.replicas, sampler.max_imbalance, sampler.max_loras, sampler.prefix_cache_tokens) == (2, 5, 6, 64)
    cfg.write_text('[sampler]\nmax_loras = 3\n[sampler.vllm]\nmax_loras = 4\n')
    with pytest.raises(ValueError, match="'max_loras' and 'vllm.max_loras' name one setting"):
        _load(["--config", str(cfg)])
    cfg.write_text('[sampler.vllm]\nreplicas = 2\n')  # a setting in another backend's table is refused
    with pytest.raises(ValueError, match="sampler.vllm.replicas"):
        _load(["--config", str(cfg)])


def _model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_file_values_and_command_line_precedence(tmp_path):
    first, other = _model_dir(tmp_path / "models" / "m"), _model_dir(tmp_path / "other")
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f'port = 9100\ndata_dir = "d"\napi_key = ["tml-a"]\nmodel_root = ["{tmp_path / "models"}"]\n'
                   f'[model]\nm = "{first}"\n'
                   '[engine]\nmicro_batch_tokens = 512\n[sampler]\nmax_len = 4096\nbackend = "torch"\n'
                   '[limits]\nmax_num_samples = 8\nmax_seq_ahead = 4\n'
                   '[workers]\nruntime = "process"\nworld_size = 2\n[parallel]\ntp = 2\n'
                   '[client_config]\nfwdbwd_max_chunk_len = 64\n')
    config = _load(["--config", str(cfg), "--port", "9200", "--engine.micro_batch_tokens", "256",
                    "--api-key", "tml-b", "--model", f"m={other}", "--limits.max_seq_ahead", "16"])
    service = config.service
    assert config.server.port == 9200  # the command line wins
    assert service.engine.micro_batch_tokens == 256 and service.sampler.max_len == 4096
    assert (service.limits.max_num_samples, service.limits.max_seq_ahead) == (8, 16)
    assert service.models == {"m": str(other)} and service.model_roots == [(tmp_path / "models").resolve()]
    workers = config.workers
    assert (workers.runtime, workers.world_size, workers.tp) == ("process", 2, 2)
    server = config.server
    assert set(server.api_keys) == {"tml-a", "tml-b"} and server.client_config["fwdbwd_max_chunk_len"] == 64


@pytest.mark.parametrize("body, named", [
    ("bogus = 1\n", "bogus"),                                   # unknown top-level key
    ("[engine]\nmicro_batch_tokens = \"many\"\n", "engine.micro_batch_tokens"),  # wrong type
    ("[sampler]\nmax_len = 1\n", "max_len"),                    # bad value (__post_init__)
    ("[sampler]\nnope = 1\n", "sampler.nope"),                  # unknown key in a section
    ("[workers]\nruntime = \"slurm\"\n", "workers.runtime"),     # bad value of a flag section
    ("port = \"eighty\"\n", "port"),                            # wrong type at the top level
    ("[limits]\nmax_num_samples = 0\n", "limits.max_num_samples"),  # bad limit
    ("[limits]\nmax_everything = 1\n", "limits.max_everything"),    # unknown limit
    ("[parallel]\npp = 2\n", "parallel.pp"),
    ("header_timeout_s = -1\n", "header_timeout_s"),            # bad value (ServerConfig)
    ("max_requests_per_key = 1.5\n", "max_requests_per_key"),   # wrong type
])
def test_bad_config_file_exits_2_naming_the_key(tmp_path, body, named):
    cfg = tmp_path / "serve.toml"
    cfg.write_text(body)
    # in this process (helpers.cli): the config is refused before anything starts;
    # test_missing_config_file_exits_2 runs the real `python -m ember.cli` exit path
    proc = run_cli("serve", "--config", str(cfg), "--data-dir", str(tmp_path / "d"))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ember serve:")]
    assert len(lines) == 1 and named in lines[0] and "Traceback" not in proc.stderr, proc.stderr


def test_missing_config_file_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ember.cli", "serve", "--config", str(tmp_path / "none.toml")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "config file not found" in proc.stderr


def test_help_lists_every_key():
    out = run_cli("serve", "--help").stdout
    for flag in ("--config", "--sampler.max_len", "--sampler.backend", "--engine.micro_batch_tokens",
                 "--workers.runtime", "--parallel.tp", "--data-dir", "--model-root", "--limits.max_num_samples"):
        assert flag in out, flag
