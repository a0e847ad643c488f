"""Where a rank's work lands on CUDA, checked without a GPU: the default process group's
backend (`cuda:nccl,cpu:gloo`: CPU tensors have a backend too), the refusal of more ranks
than GPUs, weights gathered for the caller in host memory, and an offload that hands the
allocator's cache back to the driver. What needs a GPU is in tests/engine/test_engine_gpu.py."""

from __future__ import annotations

import pytest
import torch

from ember.workers.engine import gather_named_weights, to_host
from ember.workers.memory import release_cached_memory
from ember.workers.process import ProcessRuntime
from ember.workers.runtime import check_device_count, process_group_backend


def test_a_cuda_process_group_carries_cpu_tensors_over_gloo():
    """FSDP2 cpu_offload's gradients and the metrics' reductions are CPU tensors: NCCL alone refuses them."""
    assert process_group_backend("cuda") == "cuda:nccl,cpu:gloo"
    assert process_group_backend("cpu") == "gloo"
    assert ProcessRuntime(world_size=2, device="cpu").backend == "gloo"


def test_more_ranks_than_gpus_are_refused_at_start_up():
    check_device_count(2, 2)
    with pytest.raises(ValueError, match="world_size=3 ranks on CUDA need a GPU each, and this machine has 2"):
        check_device_count(3, 2)
    with pytest.raises(ValueError, match="has 0"):
        check_device_count(1, 0)


class _Engine:
    def named_weights(self, dtype=None):
        yield from (("a", torch.ones(2)), ("b", torch.zeros(3)))


def test_gathered_weights_stay_put_in_the_callers_own_process():
    """Inline (no process group): the caller's own tensors, not copies."""
    engine = _Engine()
    got = gather_named_weights(engine)
    assert [n for n, _ in got] == ["a", "b"]
    t = torch.ones(2)
    assert to_host(t) is t  # already on the host: no copy


def test_offload_hands_cached_cuda_blocks_back_and_does_nothing_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    assert release_cached_memory(torch.device("cpu")) is False and calls == []
    assert release_cached_memory(torch.device("cuda", 1)) is True and calls == [1]
