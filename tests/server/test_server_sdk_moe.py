"""A mixture-of-experts model over HTTP with the unmodified SDK: LoRA (experts included)
trains with the routing metrics and the auxiliary loss in forward_backward's metrics (one
colon each, as the SDK splits them), and samples with the trainer's logprobs (contract 5)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from helpers.datums import sft_datum
from helpers.server import API_KEY, MODEL_NAME, start_server

pytestmark = pytest.mark.slow  # its own `ember serve`


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    from ember.models.testing import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("moe") / "m", family="qwen3_moe", num_heads=2, num_kv_heads=2,
                             head_dim=32)
    server = start_server(Path(model), tmp_path_factory.mktemp("serve-moe"),
                          extra_args=["--engine.moe_aux_loss_coef", "0.01"])
    yield server
    server.stop()


def test_sdk_trains_and_samples_a_moe_model(moe_server):
    sc = tinker.ServiceClient(base_url=moe_server.base_url, api_key=API_KEY)
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    data = [sft_datum([5, 9, 14, 22, 31, 40, 7]), sft_datum([12, 13, 14, 15])]
    metrics = tc.forward_backward(data, "cross_entropy").result().metrics
    assert metrics["moe_load_imbalance:max"] >= 1.0 and metrics["moe_router_entropy:mean"] > 0
    assert metrics["moe_aux_loss:sum"] > 0 and "loss:sum" in metrics
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = [5, 6, 7, 8]
    seq = sampler.sample(types.ModelInput.from_ints(prompt), 1,
                         types.SamplingParams(max_tokens=6, seed=2, stop=[])).result().sequences[0]
    out = tc.forward([sft_datum(prompt + seq.tokens)], "cross_entropy").result().loss_fn_outputs[0]
    trained = np.asarray(out["logprobs"].data)[len(prompt) - 1:]
    assert np.abs(trained - np.asarray(seq.logprobs)).max() < 1e-4
