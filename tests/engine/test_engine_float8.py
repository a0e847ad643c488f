"""`EngineConfig.float8` (`ember.engine.float8`) on the CPU: every refusal names the setting
and why, and the module filter keeps lm_head, a router, the embedding and layers whose
dimensions are not divisible by 16 in high precision. The float8 training itself needs an
Ada/Hopper GPU and torchao: tests/engine/test_engine_float8_gpu.py."""

import sys

import pytest
import torch
from torch import nn
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.engine import float8


def test_float8_on_the_cpu_is_refused():
    with pytest.raises(ValueError, match=r"EngineConfig.float8 .*needs a CUDA GPU.*device is 'cpu'"):
        EngineConfig(float8=True)


def test_float8_without_a_cuda_device_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"EngineConfig.float8 .*needs a CUDA device and torch sees none"):
        float8.check_gpu("cuda")


def test_float8_on_a_gpu_older_than_ada_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100")
    with pytest.raises(RuntimeError, match=r"compute capability >= 8.9 .*Ada or Hopper.*NVIDIA A100\) is 8.0"):
        float8.check_gpu("cuda:0")


def test_float8_with_lora_is_refused_before_the_model_loads(tmp_path):
    config = EngineConfig(float8=True, device="cuda")  # the config names a device; the GPU is checked at start
    with pytest.raises(ValueError, match="LoRA is not supported with float8 yet"):
        TorchEngine.from_pretrained(tmp_path / "never-read", config, lora_config=types.LoraConfig(rank=4))


def test_a_missing_torchao_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(RuntimeError, match=r"torchao is not installed: pip install torchao"):
        float8.import_torchao()


def test_the_module_filter_keeps_head_router_embedding_and_odd_dims_in_high_precision():
    model = nn.Module()
    model.embed_tokens = nn.Embedding(84, 64)
    model.q_proj = nn.Linear(64, 64)
    model.odd = nn.Linear(64, 84)  # 84 is not a multiple of 16
    model.gate = nn.Linear(64, 16)  # a mixture-of-experts router
    model.lm_head = nn.Linear(64, 96)
    converted = [name for name, m in model.named_modules() if name and float8.module_filter(m, name)]
    assert converted == ["q_proj"]


def test_the_tiny_models_decoder_projections_are_converted(tiny_model_dir):
    from ember.models import load_model

    model = load_model(tiny_model_dir, "float32", "cpu", "sdpa")
    converted = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if float8.module_filter(m, name)}
    assert {"q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= converted
    assert "lm_head" not in converted and "embed_tokens" not in converted


def test_ember_estimate_says_it_ignores_float8(tiny_model_dir, capsys):
    import argparse

    from ember.engine import estimate_cli

    parser = argparse.ArgumentParser()
    estimate_cli.add_arguments(parser)
    base = ["--model", str(tiny_model_dir), "--tokens", "64", "--engine.device", "cuda"]
    assert estimate_cli.run(parser.parse_args(base)) == 0
    plain = capsys.readouterr().out
    assert estimate_cli.run(parser.parse_args(base + ["--engine.float8", "true"])) == 0
    with_float8 = capsys.readouterr().out
    assert "--engine.float8 is ignored by the estimate" in with_float8
    assert with_float8.startswith(plain.rstrip("\n"))  # the same figures, one note more
