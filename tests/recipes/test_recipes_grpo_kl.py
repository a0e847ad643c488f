"""GRPO with a KL penalty to a reference sampler (`kl_coef`), in process and over HTTP."""

from __future__ import annotations

import math
import random

import pytest
import tinker
from tinker import types

import ember
import ember.recipes.grpo as grpo
from ember.config import ConfigError
from ember.metrics import MetricsLogger, use_logger
from ember.recipes.common import ClientConfig, make_service_client, rl_datum
from ember.recipes.grpo import GRPOConfig, make_reference, train_grpo
from ember.recipes.rl.advantages import group_advantages, kl_k1
from ember.recipes.rl.env import Problem
from ember.recipes.rl.reference import completion_logprobs, submit_reference_logprobs
from ember.recipes.rl.rollouts import Rollout, collect_groups, submit_samples
from ember.recipes.train_cli import load_recipe_config

from .conftest import API_KEY, SERVED_NAME

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def service_client(digit_model_dir, tmp_path_factory):
    sc = ember.ServiceClient(models={"tiny": str(digit_model_dir)}, data_dir=tmp_path_factory.mktemp("ember-kl"))
    yield sc
    sc.close("success")


def legacy_minibatch_datums(groups, std_normalize):
    """`grpo.minibatch_datums` as it was before `kl_coef` (commit 99c288a), for the identity check."""
    n_seqs = sum(len(g) for g in groups)
    datums = []
    for group in groups:
        for rollout, adv in zip(group, group_advantages([r.reward for r in group], std_normalize)):
            if adv != 0.0 and rollout.tokens:
                datums.append(rl_datum(rollout.problem.tokens, rollout.tokens, rollout.logprobs, adv / n_seqs))
    return datums


def datum_bytes(d) -> tuple:
    inputs = {k: (v.dtype, list(v.shape), v.to_numpy().tobytes()) for k, v in d.loss_fn_inputs.items()}
    return repr(d), d.model_input.to_ints(), inputs


def mean_kl_probe(reference, env, problems, sampler, seed: int, n: int = 4) -> float:
    """Mean k1 = log q - log p_ref over fresh temperature-1 samples of `sampler`: KL(q || p_ref)."""
    params = types.SamplingParams(max_tokens=4, temperature=1.0, stop=env.stop())
    groups = collect_groups(env, problems, submit_samples(sampler, problems, n, params, random.Random(seed)))
    rollouts = [r for g in groups for r in g if r.tokens]
    futures = submit_reference_logprobs(reference, [(r.problem.tokens, r.tokens) for r in rollouts])
    k1 = [k for r, f in zip(rollouts, futures)
          for k in kl_k1(r.logprobs, completion_logprobs(f.result(), len(r.problem.tokens), len(r.tokens)))]
    return sum(k1) / len(k1)


def run_with_probe(service_client, digit_count_env, kl_coef: float, seed: int, steps: int = 8):
    """A GRPO run with lr 1e-2; after every step the KL of the new weights to the base model
    is measured on 8 fixed prompts x 4 samples. Returns (per-step metrics, probe KL per step)."""
    tc = service_client.create_lora_training_client(base_model="tiny", rank=8, seed=seed).result()
    env = digit_count_env(tc.get_tokenizer())
    base = service_client.create_sampling_client(base_model="tiny").result()  # = step 0 of a fresh LoRA
    probes = env.sample_problems(8, random.Random(1000 + seed))
    cfg = GRPOConfig(steps=steps, prompts_per_step=4, group_size=4, max_tokens=4, learning_rate=1e-2,
                     eval_every=1, seed=seed, kl_coef=kl_coef)
    logger = MetricsLogger()
    with use_logger(logger):
        train_grpo(tc, env, cfg, evaluate=lambda s, step: {"probe_kl": mean_kl_probe(base, env, probes, s, seed)})
    history = [m for _, m in logger.history]
    return history, [m["grpo/probe_kl"] for m in history]


def test_kl_penalty_keeps_the_policy_close_to_the_reference(service_client, digit_count_env):
    # Seeds 0-4 gave last-3 probe KL 1.47/1.43/1.54/1.01/1.49 without and 0.01/0.05/0.02/0.03/0.04 with.
    free, free_kl = run_with_probe(service_client, digit_count_env, kl_coef=0.0, seed=0)
    held, held_kl = run_with_probe(service_client, digit_count_env, kl_coef=1.0, seed=0)
    free_last, held_last = sum(free_kl[-3:]) / 3, sum(held_kl[-3:]) / 3
    assert free_last > 0.3, free_kl  # lr 1e-2 drifts measurably without the penalty
    assert held_last < 0.25 * free_last, (held_kl, free_kl)
    assert free[-1]["grpo/reward"] > free[0]["grpo/reward"]  # the drift is the policy learning the reward
    # the recipe's own measurement, on the batch it trains on: only with kl_coef > 0
    assert not any("grpo/kl_ref" in m for m in free)
    assert all(math.isfinite(m["grpo/kl_ref"]) and m["grpo/kl_ref_k3"] >= 0 for m in held)
    assert abs(held[0]["grpo/kl_ref"]) < 1e-4  # step 0 samples from the reference's own weights
    assert sum(m["grpo/kl_ref"] for m in held[-3:]) / 3 < 0.25 * free_last


def test_reference_logprobs_align_with_the_sampler(service_client, digit_count_env):
    """compute_logprobs of the sampler's own weights gives back its sampled tokens' logprobs
    (contract 5: fp32 CPU, abs 1e-4), so k1 of the policy against itself is 0."""
    tc = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    env = digit_count_env(tc.get_tokenizer())
    sampler = tc.save_weights_and_get_sampling_client().result()
    problems = env.sample_problems(3, random.Random(5))
    assert abs(mean_kl_probe(sampler, env, problems, sampler, seed=5)) < 1e-4


def test_kl_coef_zero_sends_todays_datums_and_calls_no_reference(service_client, digit_count_env):
    sent = []

    def recording(groups, datums):
        sent.append((datums, legacy_minibatch_datums(groups, cfg.std_normalize)))  # cfg: below, read at the call

    class NoReference:
        def __getattr__(self, name):
            raise AssertionError(f"kl_coef = 0 touched the reference ({name})")

    tc = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=4).result()
    cfg = GRPOConfig(steps=2, prompts_per_step=4, group_size=4, max_tokens=4, learning_rate=1e-2, minibatches=2,
                     std_normalize=True, seed=4)
    with use_logger(MetricsLogger()):
        train_grpo(tc, digit_count_env(tc.get_tokenizer()), cfg, reference=NoReference(), on_minibatch=recording)
    assert len(sent) == 4 and sum(len(new) for new, _ in sent) > 0
    for new, old in sent:
        assert [datum_bytes(d) for d in new] == [datum_bytes(d) for d in old]


def test_kl_datums_keep_constant_groups_and_centre_the_penalty():
    p = Problem(tokens=(1, 2), text="x")
    varied = [Rollout(p, [3, 4], [-1.0, -2.0], r, ref_logprobs=[-1.5, -2.0]) for r in (1.0, 0.0)]
    constant = [Rollout(p, [5], [-0.5], 1.0, ref_logprobs=[-0.3]) for _ in range(2)]
    datums = grpo.minibatch_datums([varied, constant], std_normalize=False, kl_coef=0.5)
    assert len(datums) == 4  # the constant group is sent: its KL term is a signal
    k1 = [0.5, 0.0, 0.5, 0.0, -0.2, -0.2]
    mean_k1 = sum(k1) / 6
    adv = [d.loss_fn_inputs["advantages"].data[1:] for d in datums]  # prompt position 0 dropped
    k1_N_T = ([0.5, 0.0], [0.5, 0.0], [-0.2], [-0.2])
    want = [[(a + 0.5 * (mean_k1 - k)) / 4 for k in ks] for a, ks in zip((0.5, -0.5, 0.0, 0.0), k1_N_T)]
    assert adv == [pytest.approx(w, abs=1e-6) for w in want]
    with pytest.raises(RuntimeError, match="has no reference logprobs"):
        grpo.minibatch_datums([[Rollout(p, [3], [-1.0], 1.0)]], std_normalize=False, kl_coef=0.5)


def test_bad_kl_settings_are_refused(service_client):
    with pytest.raises(ValueError, match=r"GRPOConfig.kl_coef must be a finite number >= 0, got -0.1"):
        GRPOConfig(kl_coef=-0.1)
    with pytest.raises(ValueError, match=r"GRPOConfig.kl_coef must be a finite number >= 0, got nan"):
        GRPOConfig(kl_coef=float("nan"))
    with pytest.raises(ValueError, match=r"kl_reference is 'tiny' but kl_coef is 0"):
        GRPOConfig(kl_reference="tiny")
    for bad in ("http://host/model", "tinker://run/optimizer/x", "tinker://run/sampler_weights/a/b", " tiny", "a b"):
        with pytest.raises(ValueError, match=r"kl_reference must be '' \(the policy's step-0 weights\), a "
                                             r"tinker://<run>/sampler_weights/<name>.* got"):
            GRPOConfig(kl_coef=0.1, kl_reference=bad)
    GRPOConfig(kl_coef=0.1, kl_reference="Qwen/Qwen3-8B")  # spellings that are accepted
    GRPOConfig(kl_coef=0.1, kl_reference="tinker://run-1/sampler_weights/step0")
    with pytest.raises(ConfigError, match="kl_coef"):  # `ember train grpo --kl_coef -1`
        load_recipe_config("grpo", ["--kl_coef", "-1"])
    # well-formed but naming nothing this service has: refused when the reference is made
    with pytest.raises(ValueError, match=r"GRPOConfig.kl_reference 'no-such-model': no reference sampler"):
        make_reference(service_client, "no-such-model")
    with pytest.raises(ValueError, match=r"GRPOConfig.kl_reference 'tinker://nope/sampler_weights/x'"):
        make_reference(service_client, "tinker://nope/sampler_weights/x")


def test_grpo_with_kl_over_http(ember_server, digit_count_env):
    """The official SDK's SamplingClient as the reference (a base-model sampler), 2 steps."""
    service_client = make_service_client(ClientConfig(base_url=ember_server, api_key=API_KEY))
    try:
        assert isinstance(service_client, tinker.ServiceClient)
        tc = service_client.create_lora_training_client(base_model=SERVED_NAME, rank=4, seed=0).result()
        reference = make_reference(service_client, SERVED_NAME)
        env = digit_count_env(tc.get_tokenizer())
        cfg = GRPOConfig(steps=2, prompts_per_step=3, group_size=4, max_tokens=4, learning_rate=1e-2, minibatches=3,
                         kl_coef=0.5, kl_reference=SERVED_NAME, seed=0)
        logger = MetricsLogger()
        with use_logger(logger):
            train_grpo(tc, env, cfg, reference=reference)
        history = [m for _, m in logger.history]
        assert len(history) == 2 and all("grpo/loss" in m for m in history)
        assert abs(history[0]["grpo/kl_ref"]) < 1e-4  # a fresh LoRA is the base model at step 0
        assert all(m["grpo/kl_ref_k3"] >= 0 for m in history)
        with pytest.raises(ValueError, match=r"GRPOConfig.kl_reference 'tinker://nope/sampler_weights/x'"):
            make_reference(service_client, "tinker://nope/sampler_weights/x")
    finally:  # an open SDK client heartbeats its session for ever
        service_client.close("success")


def test_default_reference_outlives_sampler_eviction(digit_model_dir, digit_count_env, tmp_path):
    """The step-0 reference is saved weights, not an in-memory snapshot: when the service evicts it
    (more snapshots than `max_samplers_per_session`), it is reloaded from disk and the run goes on."""
    from ember.service.config import ServiceConfig

    config = ServiceConfig(data_dir=tmp_path / "data", models={"tiny": str(digit_model_dir)},
                           max_samplers_per_session=2)
    sc = ember.ServiceClient(config=config)
    try:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
        cfg = GRPOConfig(steps=5, prompts_per_step=2, group_size=4, max_tokens=4, learning_rate=1e-2,
                         kl_coef=0.5, seed=0)
        logger = MetricsLogger()
        with use_logger(logger):
            train_grpo(tc, digit_count_env(tc.get_tokenizer()), cfg)
        kl = [m["grpo/kl_ref"] for _, m in logger.history]
        assert len(kl) == 5 and abs(kl[0]) < 1e-4 and all(math.isfinite(k) for k in kl)
    finally:
        sc.close("success")
