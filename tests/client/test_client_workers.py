"""`ember.ServiceClient(..., workers=...)`: training runs on a worker group the in-process
service owns (the `process`-runtime twin over HTTP is tests/server/test_server_workers.py)."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types

import ember
from helpers.server import sft_datum
from ember.service.config import WorkersConfig
from ember.service.engines import LocalEngineFactory, WorkerGroupEngineFactory

MODEL = "ember-test/tiny-qwen3"
LR = types.AdamParams(learning_rate=5e-3)
PROMPT = [5, 17, 30, 42, 8, 61]


def batch() -> list[types.Datum]:
    return [sft_datum([5, 6, 7, 8, 9, 10], [0.0, 1.0, 1.0, 0.5, 2.0]), sft_datum([11, 12, 13, 14])]


def sft(sc, steps: int = 3):
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=5).result()
    losses = []
    for _ in range(steps):
        losses.append(tc.forward_backward(batch(), "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(LR).result()
    return tc, losses


def test_worker_group_engines_match_local_engines_and_close_with_the_client(make_client, tmp_path):
    grouped = make_client(tmp_path / "group", workers={"runtime": "inline"})
    factory = grouped.service.debug_state().engine_factory
    assert isinstance(factory, WorkerGroupEngineFactory) and factory.owns_group
    tc, on_group = sft(grouped)
    _, local = sft(make_client(tmp_path / "local"))
    np.testing.assert_allclose(on_group, local, rtol=1e-5, atol=0)
    assert on_group[2] < on_group[0]

    sampler = tc.save_weights_and_get_sampling_client().result()
    seq = sampler.sample(types.ModelInput.from_ints(PROMPT), 1,
                         types.SamplingParams(max_tokens=6, seed=1, stop=[])).result().sequences[0]
    fwd = tc.forward([sft_datum(PROMPT + list(seq.tokens))], "cross_entropy").result()
    expected = fwd.loss_fn_outputs[0]["logprobs"].to_numpy()[len(PROMPT) - 1:]
    np.testing.assert_allclose(seq.logprobs, expected, rtol=0, atol=1e-4)

    grouped.close("success")
    assert factory.group.broken == "shut down"  # the service owned the group and shut it down


def test_default_is_the_local_factory(make_client):
    assert isinstance(make_client().service.debug_state().engine_factory, LocalEngineFactory)


def test_clients_sharing_a_service_must_agree_on_workers(make_client, tmp_path):
    make_client(tmp_path / "shared")
    with pytest.raises(ValueError, match="another configuration: workers="):
        make_client(tmp_path / "shared", workers=WorkersConfig(runtime="inline"))
    make_client(tmp_path / "shared", workers=WorkersConfig())  # the default equals "local"


@pytest.mark.parametrize("workers, words", [
    ({"runtime": "process", "world_size": 2, "tp": 3}, "does not divide"),
    ({"runtime": "process", "world_size": 2, "dp_shard": 2, "tp": 2}, "= 4 ranks, but workers.world_size=2"),
    ({"runtime": "gpu"}, "workers.runtime must be one of"),
    ({"runtime": "local", "dp_shard": 2}, "need a worker group"),
    ({"runtime": "process", "ranks": 2}, "unexpected keyword argument 'ranks'"),
])
def test_bad_workers_are_rejected_before_anything_starts(make_client, workers, words):
    with pytest.raises(ValueError, match=words):
        make_client(workers=workers)


def test_service_and_workers_are_exclusive(make_client):
    with pytest.raises(ValueError, match="either service or workers"):
        ember.ServiceClient(service=make_client().service, workers={"runtime": "inline"})
