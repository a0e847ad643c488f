"""Colocation (SamplerConfig.colocate): around every training op, on the run's lane, the
samplers are put to sleep and the engine is onloaded, and it is offloaded after."""

from __future__ import annotations

import threading

import pytest
from tinker import types

from helpers.datums import sft_datum
from ember.sampling import SamplerConfig, resolve_sampler_config

from .conftest import new_run, result


def test_hooks_wrap_every_op_on_the_runs_lane(make_service):
    svc = make_service()
    calls: list[tuple[str, str]] = []
    svc.wrap_ops(lambda run: calls.append(("before", threading.current_thread().name)),
                 lambda run: calls.append(("after", threading.current_thread().name)))
    sid, model_id = new_run(svc)
    sub = svc.forward_backward("alice", model_id, 1, [sft_datum([5, 6, 7, 8])], "cross_entropy")
    result(svc, "alice", sub)
    sub = svc.optim_step("alice", model_id, 2, types.AdamParams(learning_rate=1e-3))
    result(svc, "alice", sub)
    assert [c[0] for c in calls] == ["before", "after", "before", "after"]
    assert len({c[1] for c in calls}) == 1 and calls[0][1] != threading.current_thread().name


def test_colocate_needs_cuda():
    with pytest.raises(ValueError, match="colocate needs a CUDA device"):
        SamplerConfig(backend="vllm", colocate=True, device="cpu")
    # left to follow a CPU trainer, it is refused when resolved
    with pytest.raises(ValueError, match="colocate needs a CUDA device"):
        resolve_sampler_config(SamplerConfig(backend="vllm", colocate=True), device="cpu", dtype="float32")


# vLLM's first answer includes its engine's start: a process of its own, the model's load,
# CUDA graphs or torch.compile; SamplerConfig.engine_start_timeout_s's default bounds it.
ENGINE_START_S = 600.0


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.needs_vllm
def test_colocated_vllm_sleeps_while_training_and_wakes_to_sample(tmp_path, tiny_vllm_model_dir):
    """vLLM (head_dim 32: a size every CUDA attention backend has) sleeps while the trainer
    works; the offloaded trainer hands its cached blocks back to the driver, so its reserved
    memory (what vLLM, another process, cannot use) falls below its peak."""
    import torch

    from ember.engine import EngineConfig
    from ember.service import Service, ServiceConfig

    cfg = ServiceConfig(data_dir=tmp_path / "data", models={"tiny": str(tiny_vllm_model_dir)},
                        engine=EngineConfig(device="cuda"),
                        sampler=SamplerConfig(backend="vllm", colocate=True, gpu_memory_utilization=0.3))
    with Service(cfg) as svc:
        sid, model_id = new_run(svc)
        sampler_id = result(svc, "alice", svc.save_weights_for_sampler("alice", model_id, 1,
                                                                       sampling_session_seq_id=0)).sampling_session_id
        prompt = types.ModelInput.from_ints([5, 6, 7])
        params = types.SamplingParams(max_tokens=4, seed=1)
        assert result(svc, "alice", svc.sample("alice", sampler_id, 0, prompt, 2, params),
                      timeout=ENGINE_START_S).sequences
        awake = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        sub = svc.forward_backward("alice", model_id, 2, [sft_datum([5, 6, 7, 8])], "cross_entropy")
        result(svc, "alice", sub)
        assert torch.cuda.memory_reserved() < torch.cuda.max_memory_reserved()  # offload emptied the cache
        backend = svc.debug_state().samplers["backends"]["tiny"]  # the one the sampler above runs on
        assert backend.asleep  # released the GPU while the trainer ran
        assert backend.sleep_stats["sleeps"] >= 1
        assert result(svc, "alice", svc.sample("alice", sampler_id, 1, prompt, 2, params),
                      timeout=ENGINE_START_S).sequences
        assert not backend.asleep and torch.cuda.memory_allocated() <= awake * 1.5
        assert backend.sleep_stats["wakes"] >= 1
