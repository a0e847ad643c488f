"""Backends are chosen by name from plain dict registries: sampler backends, engine
backends, worker runtimes, heads, model families. Every entry resolves to what it names,
and an unknown name is a clear error listing the registry's keys (read from the registry,
never a hand copy of it: adding an entry is one line in one file, not two)."""

from __future__ import annotations

import re

import pytest

from ember.engine.config import EngineConfig
from ember.engine.registry import ENGINE_BACKENDS, engine_class
from ember.sampling import SamplerConfig, TorchSampler, create_sampler
from ember.sampling.registry import SAMPLER_BACKENDS, backend_missing, sampler_class
from ember.service.config import WorkersConfig, worker_runtimes
from ember.workers import RUNTIMES, make_runtime


def known(registry) -> str:
    return re.escape(", ".join(registry))


@pytest.mark.slow  # resolving every backend imports vLLM (10-20 s of the worker); `make test-fast` never does
def test_sampler_backends():
    assert sampler_class("torch") is TorchSampler
    for name in SAMPLER_BACKENDS:  # each resolves, or says why it cannot here (vLLM not installed)
        reason = backend_missing(name)
        assert isinstance(sampler_class(name), type) if reason is None else reason.strip()
    with pytest.raises(ValueError, match=rf"unknown sampler backend 'sglang'; known: {known(SAMPLER_BACKENDS)}$"):
        sampler_class("sglang")
    assert backend_missing("torch") is None and "sglang" in backend_missing("sglang")


def test_create_sampler_by_name(tiny_model_dir):
    with create_sampler(tiny_model_dir, SamplerConfig(backend="torch", max_slots=2)) as s:
        assert isinstance(s, TorchSampler)


def test_engine_backends():
    from ember.engine.torch_engine import TorchEngine

    assert engine_class("torch") is TorchEngine
    assert all(isinstance(engine_class(name), type) for name in ENGINE_BACKENDS)
    with pytest.raises(ValueError, match=rf"unknown engine backend 'jax'; known: {known(ENGINE_BACKENDS)}"):
        engine_class("jax")
    with pytest.raises(ValueError, match=rf"EngineConfig.backend 'jax' is unknown; known: {known(ENGINE_BACKENDS)}"):
        EngineConfig(backend="jax")


def test_worker_runtimes():
    assert worker_runtimes() == ("local", *RUNTIMES)
    with pytest.raises(ValueError, match=rf"unknown runtime 'slurm'; known: {known(RUNTIMES)}"):
        make_runtime("slurm", 1)
    with pytest.raises(ValueError, match=rf"must be one of {known(worker_runtimes())}"):
        WorkersConfig(runtime="slurm")
    runtime = make_runtime("inline", 1)
    assert type(runtime).__name__ == "InlineRuntime"


def test_heads(tiny_model_dir):
    from transformers import AutoConfig

    from ember.engine.heads import HEADS, ValueHead, build_head

    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert all(build_head(name, config, seed=0).output in ("logprobs", "values") for name in HEADS)
    assert build_head("policy", config).output == "logprobs"
    value = build_head("value", config, seed=0)
    assert isinstance(value, ValueHead) and value.output == "values" and value.score.in_features == config.hidden_size
    with pytest.raises(ValueError, match=rf"head must be one of {known(HEADS)}; got 'critic'"):
        build_head("critic", config)


def test_model_families():
    from ember.models.families import FAMILIES, family_of

    assert FAMILIES and all(family_of(type("Cfg", (), {"model_type": name})()) is FAMILIES[name] for name in FAMILIES)


def test_one_loader_for_every_registry():
    """`ember.registry.load` / `lookup`: the "module:Name" loader every registry uses."""
    import json

    from ember.registry import load, lookup

    assert load("json:dumps") is json.dumps and load("json") is json
    assert load("ember.engine.registry:ENGINE_BACKENDS.get") == ENGINE_BACKENDS.get
    registry = {"enc": "json:JSONEncoder", "gone": "ember.no_such_module:X", "typo": "json:NoSuchName"}
    assert lookup(registry, "enc", "codec") is json.JSONEncoder
    with pytest.raises(ValueError, match=r"unknown codec 'yaml'; known: enc, gone, typo"):
        lookup(registry, "yaml", "codec")
    with pytest.raises(ImportError):
        lookup(registry, "gone", "codec")
    with pytest.raises(AttributeError):
        lookup(registry, "typo", "codec")
    SAMPLER_BACKENDS["broken"] = "ember.no_such_module:Sampler"
    try:  # a backend whose module does not import is "not available", with the reason
        assert "sampler backend 'broken' is not available" in backend_missing("broken")
    finally:
        del SAMPLER_BACKENDS["broken"]
