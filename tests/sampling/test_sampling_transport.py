"""The weight transport is chosen once from `SamplerConfig.weight_sync`
(ember.sampling.transport): a pool's `FileTransport` keeps a version as a file until it
is released, its `MemoryTransport` keeps the tensors and answers for a released version
without calling any replica; a vLLM sampler's transport follows the same setting.
No processes here: the transfers themselves are test_sampling_weight_sync.py's."""

from __future__ import annotations

import os

import torch

from ember.sampling import SamplerConfig
from ember.sampling.transport import FileTransport, MemoryTransport, pool_transport


def test_the_pool_transport_is_the_one_the_config_names(tmp_path):
    assert isinstance(pool_transport(SamplerConfig(replicas=2), str(tmp_path)), FileTransport)
    memory = pool_transport(SamplerConfig(replicas=2, weight_sync="memory"), str(tmp_path))
    try:
        assert isinstance(memory, MemoryTransport) and memory.mode == "memory"
    finally:
        memory.close()


def test_a_file_version_lives_until_released(tmp_path):
    transport = FileTransport(str(tmp_path))
    nbytes = transport.keep(1, [("w", torch.ones(4)), ("b", torch.zeros(2))], None)
    path = transport.path(1)
    assert transport.holds(1) and nbytes == os.path.getsize(path) > 6 * 4
    transport.release(1)  # the last handle died: the file goes at once
    assert not transport.holds(1) and not os.path.exists(path)
    transport.forget([1])  # then the pool forgets it: nothing left to remove, no error


def test_a_released_memory_version_fails_its_load_without_a_call(tmp_path):
    transport = pool_transport(SamplerConfig(replicas=2, weight_sync="memory"), str(tmp_path))
    try:
        assert transport.keep(3, [("w", torch.ones(4))], None) == 16 and transport.holds(3)
        transport.forget([3])
        # a replica object that would fail if called: a released version must not reach it
        loaded, failed = transport.load({0: object()}, 3)
        assert loaded == [] and "version 3 was released" in failed[0] and not transport.holds(3)
    finally:
        transport.close()


def test_the_vllm_engine_transport_follows_the_same_setting():
    from ember.sampling.transport.engine import FileEngineTransport, engine_transport

    transport = engine_transport(SamplerConfig(backend="vllm"))
    assert isinstance(transport, FileEngineTransport) and transport.engine_options() == {}
