"""ServerConfig, API keys, `ember serve` argument parsing, metric-key sanitising."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from ember.server import cli
from ember.server.config import (
    DEFAULT_CLIENT_CONFIG,
    UNSERVED_FLAGS,
    ServerConfig,
    is_loopback,
    key_identity,
    load_api_keys_file,
)
from ember.server.wire import metric_key, sanitize_metrics


def test_long_poll_must_stay_under_the_sdk_timeout():
    assert ServerConfig().long_poll_s == 20.0
    with pytest.raises(ValueError, match="long_poll_s"):
        ServerConfig(long_poll_s=40)
    with pytest.raises(ValueError, match="long_poll_s"):
        ServerConfig(long_poll_s=0)


def test_keys_loopback_and_owners():
    with pytest.raises(ValueError, match="refusing to serve on '0.0.0.0'"):
        ServerConfig(host="0.0.0.0")
    with pytest.raises(ValueError, match="tml-"):
        ServerConfig(api_keys={"sk-abc": "x"})
    open_cfg = ServerConfig()  # loopback, no keys: any tml- key is its own tenant
    assert open_cfg.owner_for("tml-a") == key_identity("tml-a") != open_cfg.owner_for("tml-b")
    assert open_cfg.owner_for("sk-a") is None and open_cfg.owner_for(None) is None
    cfg = ServerConfig(host="0.0.0.0", api_keys={"tml-a": "alice", "tml-b": "bob"})
    assert (cfg.owner_for("tml-a"), cfg.owner_for("tml-b"), cfg.owner_for("tml-c")) == ("alice", "bob", None)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.1") and not is_loopback("example.com")
    assert "tml-a" not in key_identity("tml-a")  # the stored identity does not reveal the key


def test_api_keys_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# comment\ntml-one alice\n\ntml-two   # no owner\n")
    assert load_api_keys_file(path) == {"tml-one": "alice", "tml-two": key_identity("tml-two")}
    path.write_text("tml-x a b\n")
    with pytest.raises(ValueError, match=r"keys:1: expected 'KEY \[OWNER\]'"):
        load_api_keys_file(path)


def test_client_config_defaults_keep_flag_endpoints_off():
    cfg = ServerConfig(client_config={"fwdbwd_max_chunk_len": 8})
    assert cfg.client_config["fwdbwd_max_chunk_len"] == 8
    for flag in ("pjwt_auth_enabled", "sample_use_retrieve_futures", "custom_loss_server_side",
                 "sample_join_sampling_session", "proto_compress_fwdbwd"):
        assert cfg.client_config[flag] is False
    with pytest.raises(ValueError):
        ServerConfig(client_config={"fwdbwd_max_chunk_len": "many"})
    assert set(DEFAULT_CLIENT_CONFIG) <= set(cfg.client_config)


@pytest.mark.parametrize("table,flag", list(UNSERVED_FLAGS), ids=[f for _, f in UNSERVED_FLAGS])
def test_a_flag_for_a_route_ember_refuses_cannot_be_turned_on(table, flag):
    with pytest.raises(ValueError, match=f"{table}.{flag}: ember does not serve {UNSERVED_FLAGS[table, flag]}"):
        ServerConfig(**{table: {flag: True}})
    assert ServerConfig(**{table: {flag: False}})  # off, as by default, is fine


def test_engine_options_match_engine_config():
    from ember.config import settings
    from ember.engine.config import EngineConfig

    options = {s.key: str(s.annotation) for s in settings(EngineConfig)}
    assert list(options) == [f.name for f in dataclasses.fields(EngineConfig)]
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    for f in dataclasses.fields(EngineConfig):
        if f.default is not None:
            assert type(f.default).__name__ in options[f.name], f.name
        assert f"--engine.{f.name}" in parser.format_help(), f.name


def test_serve_arguments(tmp_path):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    keys = tmp_path / "keys"
    keys.write_text("tml-file carol\n")
    m, b = tmp_path / "models" / "m", tmp_path / "x"
    for d in (m, b):
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
    args = parser.parse_args([
        "--model", f"org/m={m}", "--model", f"b={b}", "--api-key", "tml-1", "--api-keys-file", str(keys),
        "--client-config", "fwdbwd_max_chunk_len=8", "--client-config", "parallel_fwdbwd_chunks=true",
        "--engine.micro_batch_tokens", "128", "--engine.packing", "false", "--data-dir", str(tmp_path / "d"),
        "--seq-gap-timeout-s", "2.5", "--path-prefix", "p/",
    ])
    config = cli.load_serve_config(args)
    server = config.server
    assert server.api_keys == {"tml-1": key_identity("tml-1"), "tml-file": "carol"}
    assert server.client_config["fwdbwd_max_chunk_len"] == 8 and server.client_config["parallel_fwdbwd_chunks"] is True
    assert server.path_prefix == "/p" and server.host == "127.0.0.1"
    service = config.service
    assert service.models == {"org/m": str(m), "b": str(b)}
    assert (service.engine.micro_batch_tokens, service.engine.packing, service.seq_gap_timeout_s) == (128, False, 2.5)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "no-equals-sign"])


def test_serve_is_the_ember_subcommand(tmp_path):
    from ember import cli as dispatcher

    (tmp_path / "config.json").write_text("{}")
    args = dispatcher.build_parser("serve").parse_args(["serve", "--model", f"a={tmp_path}", "--port", "0",
                                                        "--data-dir", str(tmp_path / "d")])
    config = cli.load_serve_config(args)  # the flags' values are typed by ember.config, not argparse
    assert args.command_module is cli and config.service.models == {"a": str(tmp_path)} and config.server.host == "127.0.0.1"


@pytest.mark.parametrize("key, want", [
    ("loss:sum", "loss:sum"), ("loss", "loss:sum"), ("grad_norm", "grad_norm:mean"),
    ("a:b:c", "a_b:c"), (":x", "x:mean"), ("x:", "x:mean"),
])
def test_metric_keys_get_exactly_one_colon(key, want):
    assert metric_key(key) == want
    assert sanitize_metrics({key: 1}) == {want: 1.0}


def test_presented_key_is_read_in_one_place():
    """X-API-Key first, else `Authorization: Bearer`; anything else is no key. The routes,
    the per-key bound and /metrics all call this one function."""
    from starlette.datastructures import Headers

    from ember.server import deps, metrics, request_guards
    from ember.server.config import presented_key

    assert presented_key(Headers({"X-API-Key": "tml-a", "Authorization": "Bearer tml-b"})) == "tml-a"
    assert presented_key(Headers({"authorization": "bearer  tml-b "})) == "tml-b"
    for headers in ({}, {"authorization": "Basic dG1sLWI="}, {"authorization": "Bearer "}, {"x-api-key": ""}):
        assert presented_key(Headers(headers)) is None, headers
    assert deps.presented_key is metrics.presented_key is request_guards.presented_key is presented_key


def test_the_start_up_memory_check_counts_a_vllm_sampler_on_the_trainers_gpu(tiny_model_dir):
    """Not colocated, vLLM holds its share of the trainer's GPU while the trainer trains;
    colocated (it sleeps then), on another GPU, or on the CPU it takes nothing from it."""
    from types import SimpleNamespace

    from ember.engine import EngineConfig
    from ember.sampling import SamplerConfig
    from ember.service.model_registry import BaseModel
    from ember.service.samplers import LocalSamplerFactory

    def reserved(engine: EngineConfig, sampler: SamplerConfig) -> int:
        registry = SimpleNamespace(names=lambda: ["tiny"], resolve=lambda name: BaseModel("tiny", tiny_model_dir))
        service = SimpleNamespace(config=SimpleNamespace(engine=engine), registry=registry,
                                  samplers=SimpleNamespace(factory=LocalSamplerFactory(sampler, engine)))
        return cli.sampler_reserved_bytes(service, gpu_total_bytes=1000)

    gpu = EngineConfig(device="cuda:0")
    assert reserved(gpu, SamplerConfig(backend="vllm", gpu_memory_utilization=0.3)) == 300
    assert reserved(gpu, SamplerConfig(backend="vllm", gpu_memory_utilization=0.3, colocate=True)) == 0
    assert reserved(gpu, SamplerConfig(backend="vllm", device="cuda:1")) == 0
    assert reserved(gpu, SamplerConfig(backend="torch")) == 0
    assert reserved(EngineConfig(), SamplerConfig(backend="vllm")) == 0
