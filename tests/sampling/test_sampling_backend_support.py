"""A sampler backend refuses a model it cannot serve when the sampler is created (and
`ember serve` at start-up, for registered models), naming the config.json field and what
the backend supports; an engine failure reaches the client without pointing at a log."""

from __future__ import annotations

import json
import shutil

import pytest

from ember.sampling import SamplerConfig
from ember.sampling.base import UnsupportedModelError
from ember.sampling.registry import check_model
from ember.sampling.vllm_support import engine_fault_message, head_dim_of

needs_vllm = pytest.mark.needs_vllm


@pytest.fixture(scope="module")
def hd16_model_dir(tmp_path_factory):
    """A tiny Qwen3 with head_dim 16 (tests/sampling's `tiny_model_dir` has 32)."""
    from ember.models.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-hd16"), family="qwen3", seed=0, head_dim=16)


class EngineDeadError(Exception):
    """Stands in for vllm.v1.engine.exceptions.EngineDeadError (matched by name), whose
    message is exactly this."""

    def __init__(self) -> None:
        super().__init__("EngineCore encountered an issue. See stack trace (above) for the root cause.")


def test_engine_failures_never_point_at_a_log():
    message = engine_fault_message(EngineDeadError())
    assert "stack trace" not in message and "above" not in message
    assert message.startswith("sampling failed: the vLLM engine process died;")
    other = engine_fault_message(RuntimeError("CUDA out of memory. See the logs above for details."))
    assert other == "sampling failed in the vLLM engine (RuntimeError: CUDA out of memory.)"


@pytest.mark.parametrize("config, expected", [
    ({"head_dim": 16, "hidden_size": 128, "num_attention_heads": 2}, (16, "head_dim")),
    ({"hidden_size": 64, "num_attention_heads": 4}, (16, "hidden_size/num_attention_heads")),
    ({}, (None, "head_dim")),
])
def test_head_dim_is_read_as_vllm_reads_it(config, expected):
    assert head_dim_of(config) == expected


def test_the_torch_backend_serves_any_head_size(hd16_model_dir):
    check_model(hd16_model_dir, SamplerConfig(backend="torch", device="cpu"))  # head_dim 16: no error


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.slow  # importing vLLM takes tens of seconds
@needs_vllm
def test_vllm_refuses_head_dim_16_on_cpu_when_the_sampler_is_created(hd16_model_dir, tiny_vllm_model_dir, tmp_path):
    from ember.sampling.vllm_sampler import VLLMSampler

    cpu = SamplerConfig(backend="vllm", device="cpu")
    with pytest.raises(UnsupportedModelError) as info:
        check_model(hd16_model_dir, cpu)
    assert str(info.value).startswith("head_dim=16: vLLM's CPU attention supports head_dim 32, 64")
    assert "(config.json head_dim)" in str(info.value)
    no_head_dim = tmp_path / "derived"
    _with_config(hd16_model_dir, no_head_dim)
    config = json.loads((no_head_dim / "config.json").read_text())
    del config["head_dim"]
    (no_head_dim / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"config.json hidden_size/num_attention_heads"):
        VLLMSampler.from_pretrained(no_head_dim, cpu, scratch_dir=tmp_path / "scratch")  # refused before an engine
    assert not (tmp_path / "scratch").exists()
    check_model(tiny_vllm_model_dir, cpu)  # head_dim 32: served
    check_model(hd16_model_dir, SamplerConfig(backend="vllm", device="cuda"))  # vLLM picks a CUDA backend itself


@pytest.mark.slow  # importing vLLM takes tens of seconds
@needs_vllm
def test_ember_serve_refuses_a_registered_model_at_start_up(hd16_model_dir, tmp_path, capsys):
    from ember.server.cli import main

    code = main(["--model", f"tiny={hd16_model_dir}", "--sampler.backend", "vllm", "--data-dir",
                 str(tmp_path / "data"), "--port", "0"])
    assert code == 2
    err = capsys.readouterr().err
    assert "model 'tiny': the sampler backend cannot serve it: head_dim=16: vLLM's CPU attention supports" in err
    assert "config.json head_dim" in err


@pytest.mark.slow  # importing vLLM takes tens of seconds
@needs_vllm
def test_a_model_named_by_path_is_refused_when_its_sampler_is_created(hd16_model_dir, tmp_path):
    import tinker

    import ember
    from helpers.server import sft_datum
    from ember.service.config import ServiceConfig

    root = tmp_path / "models"
    model = _with_config(hd16_model_dir, root / "m")
    config = ServiceConfig(data_dir=tmp_path / "data", models={}, model_roots=[str(root)],
                           sampler=SamplerConfig(backend="vllm"))
    sc = ember.ServiceClient(config=config)
    try:
        with pytest.raises((tinker.TinkerError, ValueError)) as info:
            sc.create_sampling_client(base_model=str(model)).result()
        assert f"base model {str(model)!r}: the sampler backend cannot serve it: head_dim=16" in str(info.value)
        tc = sc.create_lora_training_client(base_model=str(model), rank=4).result()  # training is unaffected
        out = tc.forward([sft_datum([5, 17, 30, 42])], "cross_entropy").result()
        assert len(out.loss_fn_outputs) == 1
    finally:
        sc.close("success")


# ---------------------------------------------------------------------- vLLM's engine arguments
def test_cuda_settings_reach_vllms_engine_arguments():
    from ember.sampling.vllm_support import engine_kwargs

    cfg = SamplerConfig(backend="vllm", device="cuda:1", dtype="bfloat16", gpu_memory_utilization=0.42,
                        tensor_parallel_size=2, max_prefill_tokens=4096, colocate=True)
    kw = engine_kwargs("/m", cfg, max_len=131072)
    assert kw["dtype"] == "bfloat16" and kw["gpu_memory_utilization"] == 0.42 and kw["tensor_parallel_size"] == 2
    # chunked prefill: the start-up profile runs max_prefill_tokens, not the model's whole context
    assert kw["max_num_batched_tokens"] == 4096 and kw["enable_chunked_prefill"] is True
    assert kw["enable_sleep_mode"] is True and kw["enable_lora"] is True and kw["max_lora_rank"] == 64
    assert engine_kwargs("/m", SamplerConfig(backend="vllm", device="cuda"), 128)["gpu_memory_utilization"] == 0.5
    no_lora = engine_kwargs("/m", SamplerConfig(backend="vllm", device="cuda", enable_lora=False), 128)
    assert no_lora["enable_lora"] is False and "max_loras" not in no_lora and "max_lora_rank" not in no_lora


def test_cpu_engine_arguments_keep_the_cpu_builds_rules():
    from ember.sampling.vllm_support import engine_kwargs

    kw = engine_kwargs("/m", SamplerConfig(backend="vllm", device="cpu", max_prefill_tokens=64), max_len=128)
    assert kw["max_num_batched_tokens"] == 128 and kw["distributed_executor_backend"] == "uni"
    assert not {"gpu_memory_utilization", "tensor_parallel_size", "enable_chunked_prefill"} & set(kw)


@pytest.mark.parametrize("device, tp, parent, visible", [
    ("cuda:2", 1, None, "2"),
    ("cuda", 1, None, "0"),
    ("cuda:1", 2, None, "1,2"),
    ("cuda:1", 2, "4,5,6", "5,6"),  # indices of this process's own view
    ("cuda:0", 1, "GPU-aaaa,GPU-bbbb", "GPU-aaaa"),
    ("cpu", 1, None, None),
])
def test_a_vllm_engine_sees_the_samplers_gpus(device, tp, parent, visible):
    from ember.sampling.vllm_support import visible_devices

    assert visible_devices(device, tp, parent) == visible


def test_a_vllm_layout_past_the_visible_gpus_is_refused():
    from ember.sampling.vllm_support import visible_devices

    with pytest.raises(ValueError, match="needs GPUs 1..2, and CUDA_VISIBLE_DEVICES='3,4' shows 2"):
        visible_devices("cuda:1", 2, "3,4")
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        SamplerConfig(backend="vllm", tensor_parallel_size=0)
