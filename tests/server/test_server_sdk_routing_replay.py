"""Routing replay over HTTP with the unmodified SDK (`ember.service.routing_records`): the
server keeps a recorded MoE sample's routes; `loss_fn_config={"routing_replay": 1}` (a float
on the wire) routes a datum with provenance through them, and `--stability.routing_replay
true` makes that the default; once training moved the routes, replay changes the trainer's
logprobs; a bad value is the caller's error naming the key."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from helpers.server import API_KEY, MODEL_NAME, start_server, stable_datum

pytestmark = pytest.mark.slow  # its own `ember serve`

PROMPT = [5, 17, 30, 42, 8]


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    from ember.models.testing import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("moe") / "m", family="qwen3_moe", num_heads=2, num_kv_heads=2,
                             head_dim=32)
    server = start_server(Path(model), tmp_path_factory.mktemp("serve-replay"),
                          extra_args=["--stability.routing_replay", "true"])
    yield server
    server.stop()


def _logprobs(tc, datum, config) -> np.ndarray:
    out = tc.forward([datum], "stable_reinforce", config).result().loss_fn_outputs[0]
    return np.asarray(out["logprobs"].data)[len(PROMPT) - 1:]


def test_sdk_replays_recorded_routes(moe_server):
    sc = tinker.ServiceClient(base_url=moe_server.base_url, api_key=API_KEY)
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=1).result()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    seq = sampler.sample(types.ModelInput.from_ints(PROMPT), 1,
                         types.SamplingParams(max_tokens=8, seed=4, stop=[])).result().sequences[0]
    datum = stable_datum(PROMPT, seq)
    sampled = np.asarray(seq.logprobs)
    for config in (None, {"routing_replay": 1}, {"routing_replay": 0}):  # same weights: the contract each way
        assert np.abs(_logprobs(tc, datum, config) - sampled).max() < 1e-4
    for k in range(3):  # attention LoRA moves the hidden states the router sees
        tc.forward_backward([stable_datum(PROMPT, seq, advantage=1.0)], "stable_reinforce").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-1)).result()
    default, on, off = (_logprobs(tc, datum, c) for c in (None, {"routing_replay": 1}, {"routing_replay": 0}))
    np.testing.assert_array_equal(default, on)  # the server's default is replay
    assert np.abs(on - off).max() > 1e-6  # some token's experts moved, and replay put it back on the recorded ones
    with pytest.raises(tinker.RequestFailedError) as info:
        tc.forward([datum], "stable_reinforce", {"routing_replay": 0.5}).result()
    assert "loss_fn_config['routing_replay'] must be 0" in str(info.value)
    assert info.value.category == types.RequestErrorCategory.User
