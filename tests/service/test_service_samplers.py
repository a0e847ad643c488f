"""The sampler manager's memory bound: at most `max_samplers_per_session` snapshots stay
loaded per client session, and the one evicted is the least recently used, so a sampler
used every step (a KL reference) outlives the snapshots made after it."""

from __future__ import annotations

import pytest
from tinker import types

import ember
from helpers.datums import sft_datum
from ember.service.config import ServiceConfig

PARAMS = types.SamplingParams(max_tokens=2, seed=0, stop=[])
PROMPT = types.ModelInput.from_ints([5, 9, 14])


def sample(sampler):
    return sampler.sample(PROMPT, 1, PARAMS).result().sequences[0].tokens


def test_eviction_takes_the_least_recently_used_snapshot(tmp_path, tiny_model_dir):
    sc = ember.ServiceClient(config=ServiceConfig(data_dir=tmp_path / "data", models={"tiny": str(tiny_model_dir)},
                                                  max_samplers_per_session=2))
    try:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()

        def snapshot():
            tc.forward_backward([sft_datum([5, 9, 14, 22, 31])], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            return tc.save_weights_and_get_sampling_client().result()

        reference, first = snapshot(), snapshot()
        expected = sample(reference)
        for _ in range(3):  # like an RL step: a new snapshot samples, then the reference scores
            sample(snapshot())  # evicts the least recently used: never the reference
            assert sample(reference) == expected
        with pytest.raises(Exception, match="in-memory snapshot that is gone"):
            sample(first)  # unused since: evicted, and a snapshot cannot be reloaded
    finally:
        sc.close("success")


def test_the_sampler_follows_the_trainers_gpu_and_compute_dtype(tiny_model_dir):
    """A trainer on cuda:1 gets a sampler on cuda:1 (not "cuda", which is cuda:0), in the
    dtype it computes in: its autocast dtype when set (bf16 compute, fp32 master weights)."""
    from ember.engine import EngineConfig
    from ember.sampling import SamplerConfig
    from ember.service.model_registry import BaseModel
    from ember.service.samplers import LocalSamplerFactory

    base = BaseModel("tiny", tiny_model_dir)
    for engine, dtype in ((EngineConfig(device="cuda:1", dtype="bfloat16"), "bfloat16"),
                          (EngineConfig(device="cuda:1", autocast_dtype="bfloat16"), "bfloat16"),
                          (EngineConfig(device="cuda:1"), "float32")):
        cfg = LocalSamplerFactory(SamplerConfig(), engine).resolved_config(base)
        assert (cfg.device, cfg.dtype, cfg.gpu_memory_utilization) == ("cuda:1", dtype, None)  # torch: no share


def test_a_vllm_samplers_memory_share_is_derived_from_the_trainer_beside_it(tiny_model_dir):
    from ember.engine import EngineConfig
    from ember.engine.estimate import GiB, trainer_bytes_beside_sampler
    from ember.sampling import SamplerConfig
    from ember.service.model_registry import BaseModel
    from ember.service.samplers import LocalSamplerFactory

    base, engine, total = BaseModel("tiny", tiny_model_dir), EngineConfig(device="cuda:0"), 80 * GiB

    def share(**sampler) -> float:
        factory = LocalSamplerFactory(SamplerConfig(backend="vllm", **sampler), engine)
        return factory.resolved_config(base, gpu_total_bytes=total).gpu_memory_utilization

    assert share(device="cuda:1") == 0.9  # a GPU of its own
    beside = trainer_bytes_beside_sampler(tiny_model_dir, engine, colocate=False)
    assert share() == round(min(0.9, (total - beside - 2 * GiB) / total), 3)
    assert share(gpu_memory_utilization=0.3) == 0.3  # set: kept
