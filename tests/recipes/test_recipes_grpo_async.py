"""Asynchronous GRPO (`GRPOConfig.max_steps_off_policy` = N > 0): a rollout thread samples from an
in-flight sampling client while the trainer trains, at most N steps ahead; staleness is bounded
by N and reported per step (`staleness`, `async/staleness_mean`, `async/dropped_groups`)."""

from __future__ import annotations

import math

import pytest
from tinker import types

import ember
from ember.metrics import MetricsLogger, use_logger
from ember.recipes.grpo import GRPOConfig, train_grpo
from ember.recipes.rl.offpolicy import VersionedGroup, split_stale


def test_split_stale_drops_groups_more_than_n_steps_old():
    items = [VersionedGroup([], v) for v in (0, 1, 2, 3)]
    fresh, stale = split_stale(items, step=3, max_steps_off_policy=1)
    assert [g.version for g in fresh] == [2, 3] and [g.version for g in stale] == [0, 1]
    fresh, stale = split_stale(items, step=3, max_steps_off_policy=0)
    assert [g.version for g in fresh] == [3] and len(stale) == 3


@pytest.mark.parametrize("overrides, words", [
    (dict(max_steps_off_policy=-1), "max_steps_off_policy must be an int >= 0"),
    (dict(max_steps_off_policy=1.5), "max_steps_off_policy must be an int >= 0"),
    (dict(max_steps_off_policy=1, max_staleness=1), "set one"),
    (dict(max_steps_off_policy=1, save_every=2, run_dir="x"), "does not checkpoint"),
    (dict(max_steps_off_policy=1, resume_from="x"), "does not checkpoint"),
])
def test_bad_async_settings_are_named(overrides, words):
    with pytest.raises(ValueError, match=words):
        GRPOConfig(**overrides)


@pytest.fixture(scope="module")
def service_client(digit_model_dir, tmp_path_factory):
    sc = ember.ServiceClient(models={"tiny": str(digit_model_dir)}, data_dir=tmp_path_factory.mktemp("ember"))
    yield sc
    sc.close("success")


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2])
def test_async_grpo_runs_with_staleness_bounded_by_n(service_client, digit_count_env, n):
    tc = service_client.create_lora_training_client(base_model="tiny", rank=8, seed=1).result()
    env = digit_count_env(tc.get_tokenizer())
    cfg = GRPOConfig(steps=5, prompts_per_step=3, group_size=4, max_tokens=4, learning_rate=1e-3,
                     max_steps_off_policy=n, eval_every=5, seed=0)
    logger, seen, evals = MetricsLogger(), [], []

    def evaluate(sampler, step):
        evals.append(step)
        return {"heldout_acc": 0.25}

    with use_logger(logger):
        final = train_grpo(tc, env, cfg, on_step=lambda step, m: seen.append(step), evaluate=evaluate, prefix="grpo/")
    history = [m for _, m in logger.history]
    assert seen == list(range(5)) and evals == [5] and history[-1]["grpo/heldout_acc"] == 0.25
    assert history[0]["grpo/staleness"] == 0.0  # the first round is sampled from the step-0 weights
    assert all(0.0 <= m["grpo/staleness"] <= n for m in history), [m["grpo/staleness"] for m in history]
    assert all(0.0 <= m["grpo/async/staleness_mean"] <= m["grpo/staleness"] for m in history)
    assert all(m["grpo/async/dropped_groups"] == 0.0 for m in history)  # the gate keeps every group fresh enough
    assert all(math.isfinite(m["grpo/loss"]) and 0.0 <= m["grpo/reward"] <= 1.0 for m in history)
    assert all(m["grpo/completion_tokens"] > 0 for m in history)
    seqs = final.sample(types.ModelInput.from_ints([5, 6]), 2, types.SamplingParams(max_tokens=2)).result().sequences
    assert len(seqs) == 2


@pytest.mark.slow
def test_a_failing_rollout_thread_fails_the_run(service_client, digit_count_env):
    tc = service_client.create_lora_training_client(base_model="tiny", rank=8, seed=2).result()
    base = digit_count_env(tc.get_tokenizer())

    class Broken(type(base)):
        def reward(self, problem, completion_tokens):
            raise ValueError("verifier down")

    cfg = GRPOConfig(steps=3, prompts_per_step=2, group_size=2, max_tokens=2, max_steps_off_policy=1)
    with use_logger(MetricsLogger()), pytest.raises(RuntimeError, match="rollout thread failed: ValueError: verifier"):
        train_grpo(tc, Broken(), cfg)
