"""Both recipes, unchanged, through the official `tinker` SDK against an `ember serve` subprocess."""

from __future__ import annotations

import pytest
import json
import random

import pytest
import tinker

from ember.metrics import MetricsLogger, use_logger
from ember.recipes.common import ClientConfig, make_service_client
from ember.recipes.grpo import GRPOConfig, train_grpo
from ember.recipes.sft import SFTConfig, run_sft

from .conftest import API_KEY, SERVED_NAME

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow


def test_sft_recipe_over_http(ember_server, tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(
        json.dumps({"prompt": f"Sum the digits of {n}:", "completion": f" {sum(map(int, str(n)))}"}) + "\n"
        for n in (123, 4567, 890, 31)))
    cfg = SFTConfig(base_model=SERVED_NAME, data_path=str(data), lora_rank=4, steps=6, batch_size=4,
                    learning_rate=1e-2, save_name="sft-http",
                    client=ClientConfig(base_url=ember_server, api_key=API_KEY))
    logger = MetricsLogger()
    with use_logger(logger):
        path = run_sft(cfg)
    assert path is not None and path.startswith("tinker://") and path.endswith("/weights/sft-http")
    losses = [m["sft/loss"] for _, m in logger.history]
    assert len(losses) == 6 and losses[-1] < losses[0], losses


@pytest.fixture
def sdk_service_client(ember_server):
    """The recipe's SDK client, closed afterwards (an open one heartbeats its session for ever)."""
    client = make_service_client(ClientConfig(base_url=ember_server, api_key=API_KEY))
    yield client
    client.close("success")


def test_grpo_recipe_over_http(sdk_service_client, digit_count_env):
    service_client = sdk_service_client
    assert isinstance(service_client, tinker.ServiceClient)  # the official SDK, not ember's client
    tc = service_client.create_lora_training_client(base_model=SERVED_NAME, rank=4, seed=0).result()
    assert isinstance(tc, tinker.TrainingClient)
    env = digit_count_env(tc.get_tokenizer())
    cfg = GRPOConfig(steps=2, prompts_per_step=3, group_size=4, max_tokens=4, learning_rate=1e-3,
                     loss_fn="importance_sampling", seed=0)
    logger = MetricsLogger()
    with use_logger(logger):
        final = train_grpo(tc, env, cfg)
    history = [m for _, m in logger.history]
    assert len(history) == 2
    assert all("grpo/loss" in m and m["grpo/staleness"] == 0.0 and m["grpo/completion_tokens"] > 0 for m in history)
    prompt = env.sample_problems(1, random.Random(1))[0].tokens
    out = final.sample(tinker.types.ModelInput.from_ints(list(prompt)),
                       2, tinker.types.SamplingParams(max_tokens=3, seed=5)).result()
    assert len(out.sequences) == 2 and all(len(s.logprobs) == len(s.tokens) for s in out.sequences)
