"""Backends are chosen by name from plain dict registries: sampler backends, engine
backends, worker runtimes. An unknown name is a clear error listing the known ones."""

from __future__ import annotations

import pytest

from ember.engine.config import EngineConfig
from ember.engine.registry import ENGINE_BACKENDS, engine_class
from ember.sampling import SamplerConfig, TorchSampler, create_sampler
from ember.sampling.registry import SAMPLER_BACKENDS, backend_missing, sampler_class
from ember.service.config import WorkersConfig, worker_runtimes
from ember.workers import RUNTIMES, make_runtime


def test_sampler_backends():
    assert set(SAMPLER_BACKENDS) >= {"torch", "vllm"}
    assert sampler_class("torch") is TorchSampler
    with pytest.raises(ValueError, match=r"unknown sampler backend 'sglang'; known: torch, vllm"):
        sampler_class("sglang")
    assert backend_missing("torch") is None and "sglang" in backend_missing("sglang")


def test_create_sampler_by_name(tiny_model_dir):
    with create_sampler(tiny_model_dir, SamplerConfig(backend="torch", max_slots=2)) as s:
        assert isinstance(s, TorchSampler)


def test_engine_backends():
    from ember.engine.torch_engine import TorchEngine

    assert engine_class("torch") is TorchEngine and "torch" in ENGINE_BACKENDS
    with pytest.raises(ValueError, match=r"unknown engine backend 'jax'; known: torch"):
        engine_class("jax")
    with pytest.raises(ValueError, match=r"EngineConfig.backend 'jax' is unknown; known: torch"):
        EngineConfig(backend="jax")


def test_worker_runtimes():
    assert set(RUNTIMES) == {"inline", "process", "ray"}
    assert worker_runtimes() == ("local", *RUNTIMES)
    with pytest.raises(ValueError, match=r"unknown runtime 'slurm'; known: inline, process, ray"):
        make_runtime("slurm", 1)
    with pytest.raises(ValueError, match=r"must be one of local, inline, process, ray"):
        WorkersConfig(runtime="slurm")
    runtime = make_runtime("inline", 1)
    assert type(runtime).__name__ == "InlineRuntime"


def test_heads(tiny_model_dir):
    from transformers import AutoConfig

    from ember.engine.heads import HEADS, ValueHead, build_head

    assert set(HEADS) == {"policy", "value"}
    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert build_head("policy", config).output == "logprobs"
    value = build_head("value", config, seed=0)
    assert isinstance(value, ValueHead) and value.output == "values" and value.score.in_features == config.hidden_size
    with pytest.raises(ValueError, match=r"head must be one of policy, value; got 'critic'"):
        build_head("critic", config)


def test_model_families():
    from ember.models.families import FAMILIES, family_of

    assert set(FAMILIES) == {"llama", "mistral", "qwen2", "qwen3", "olmo2"}
    assert all(family_of(type("Cfg", (), {"model_type": name})()) is FAMILIES[name] for name in FAMILIES)
