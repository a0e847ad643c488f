"""Both recipes, a few steps on a tiny model, through the in-process `ember.ServiceClient`."""

from __future__ import annotations

import json

import pytest
from tinker import types

import ember
from ember.metrics import MetricsLogger, read_jsonl, use_logger
from ember.recipes.digit_sum import DigitSumEnv, DigitSumTask
from ember.recipes.grpo import GRPOConfig, train_grpo
from ember.recipes.rl.rollouts import evaluate_greedy
from ember.recipes.sft import SFTConfig, train_sft

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def service_client(digit_model_dir, tmp_path_factory):
    sc = ember.ServiceClient(models={"tiny": str(digit_model_dir)}, data_dir=tmp_path_factory.mktemp("ember"))
    yield sc
    sc.close("success")


def test_sft_recipe_lowers_the_loss(service_client):
    tc = service_client.create_lora_training_client(base_model="tiny", rank=8, seed=0).result()
    task = DigitSumTask(tc.get_tokenizer())
    examples = task.labelled_examples(task.numbers(16, seed=0))
    logger = MetricsLogger()
    seen = []
    with use_logger(logger):
        train_sft(tc, examples, SFTConfig(steps=12, batch_size=16, learning_rate=1e-2, eval_every=6), prefix="sft/",
                  on_step=lambda step, m: seen.append(step),
                  evaluate=lambda sampler, step: {"probe": float(step)})
    losses = [m["sft/loss"] for _, m in logger.history]
    assert seen == list(range(12))
    assert losses[-1] < 0.6 * losses[0], losses  # token-mean NLL falls on 16 memorisable examples
    assert [m.get("sft/probe") for _, m in logger.history if "sft/probe" in m] == [6.0, 12.0]
    assert all(m["sft/tokens"] == 16 * 4 for _, m in logger.history)  # " <2 digits>" + EOS... or fewer


def test_grpo_recipe_ppo_minibatches_and_staleness(service_client, digit_count_env):
    tc = service_client.create_lora_training_client(base_model="tiny", rank=8, seed=1).result()
    env = digit_count_env(tc.get_tokenizer())
    cfg = GRPOConfig(steps=3, prompts_per_step=4, group_size=4, max_tokens=4, learning_rate=1e-3,
                     loss_fn="ppo", minibatches=2, max_staleness=1, eval_every=3, seed=0)
    logger = MetricsLogger()
    evals = []

    def evaluate(sampler, step):
        evals.append(step)
        return {"heldout_acc": 0.5}

    with use_logger(logger):
        final = train_grpo(tc, env, cfg, evaluate=evaluate, prefix="grpo/")
    history = [m for _, m in logger.history]
    assert [m["grpo/staleness"] for m in history] == [0.0, 1.0, 1.0]  # k=1: each next batch sampled while one trains
    assert all("grpo/loss" in m and 0.0 <= m["grpo/reward"] <= 1.0 for m in history)
    assert evals == [3] and history[-1]["grpo/heldout_acc"] == 0.5
    assert all(m["grpo/time/train"] > 0 and m["grpo/time/sample"] >= 0 for m in history)
    # the returned sampler holds the final weights and samples
    seqs = final.sample(types.ModelInput.from_ints([5, 6]), 2, types.SamplingParams(max_tokens=2)).result().sequences
    assert len(seqs) == 2 and all(1 <= len(s.tokens) <= 2 for s in seqs)


def test_digit_sum_greedy_eval_in_process(service_client):
    tc = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
    task = DigitSumTask(tc.get_tokenizer())
    held = task.numbers(8, seed=3)
    env = DigitSumEnv(task, exclude=held)
    sampler = tc.save_weights_and_get_sampling_client().result()
    acc = evaluate_greedy(sampler, env, [task.problem(n) for n in held], max_tokens=5)
    assert acc == 0.0  # random weights cannot sum digits


def test_ember_train_sft_cli_end_to_end(recipe_toml, tmp_path, capsys):
    from ember.cli import main

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Sum the digits of {n}:", "completion": f" {sum(map(int, str(n)))}"}) + "\n"
                            for n in (123, 456, 789, 4012)))
    config = recipe_toml("sft.toml", f"""
base_model = "tiny"
data_path = "{data}"
lora_rank = 4
steps = 10
batch_size = 4
learning_rate = 0.001
run_dir = "{tmp_path / 'run'}"
""")
    assert main(["train", "sft", "--config", str(config), "--steps", "3", "--save_name", "done"]) == 0
    out = capsys.readouterr().out
    assert "saved tinker://" in out and "/weights/done" in out
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["sft/loss"] > 0 for r in rows)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["steps"] == 3
    saved = out.split("saved ", 1)[1].strip()

    # GRPO from the SFT checkpoint, same client settings from the same file, overridden on the CLI
    argv = ["train", "grpo", "--config", str(config), "--init_from", saved, "--steps", "2",
            "--prompts_per_step", "2", "--group_size", "2", "--max_tokens", "3",
            "--run_dir", str(tmp_path / "grpo-run"), "--save_name", ""]
    config.write_text(config.read_text().replace(f'data_path = "{data}"\n', "").replace("batch_size = 4\n", ""))
    assert main(argv) == 0
    rows = read_jsonl(tmp_path / "grpo-run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1] and all("grpo/reward" in r for r in rows)


def test_grpo_warns_after_steps_without_learning_signal(service_client, digit_count_env, caplog):
    """Constant rewards train nothing: after NO_SIGNAL_STEPS such steps the recipe says what to change."""
    from ember.recipes.grpo import NO_SIGNAL_STEPS

    tc = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
    graded = digit_count_env(tc.get_tokenizer())

    class Constant(type(graded)):
        def reward(self, problem, completion_tokens):
            return 0.0

    cfg = GRPOConfig(steps=NO_SIGNAL_STEPS + 1, prompts_per_step=2, group_size=2, max_tokens=2, seed=0)
    with caplog.at_level("WARNING", logger="ember.recipes.grpo"), use_logger(MetricsLogger()):
        train_grpo(tc, Constant(), cfg)
    warnings = [r.getMessage() for r in caplog.records if r.name == "ember.recipes.grpo"]
    assert len(warnings) == 1, warnings  # once per streak, not every step
    assert f"no learning signal for {NO_SIGNAL_STEPS} steps in a row" in warnings[0]
    assert "partial_credit" in warnings[0] and "init_from" in warnings[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="ember.recipes.grpo"), use_logger(MetricsLogger()):
        train_grpo(tc, graded, cfg)  # graded rewards: groups differ, every step trains
    assert not [r for r in caplog.records if r.name == "ember.recipes.grpo"]
