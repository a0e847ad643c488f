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
