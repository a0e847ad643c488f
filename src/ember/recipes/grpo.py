"""GRPO, flat, on the public Tinker API only.

Per step: P problems from the environment, G samples each from a sampler snapshot,
rewards from the environment's verifier, group-relative advantages, then
`forward_backward` (`importance_sampling` or `ppo`) + `optim_step` per mini-batch, then a
new snapshot with `save_weights_and_get_sampling_client()`. It runs unchanged on
`ember.ServiceClient()` and on `tinker.ServiceClient(base_url=...)`.

Advantages: A_i = r_i - mean(r_group) (divided by the group's std with `std_normalize`).
Tinker losses are SUMS over tokens and datums, so every completion token of sequence i
carries A_i / S, S = sequences in the mini-batch: the loss is the mean over sequences of
the per-sequence summed objective, and the LR does not depend on P*G. Groups whose rewards
are all equal have zero advantage: they are counted in S but not sent.

Off-policy: with `max_staleness = k > 0` the next batch is sampled from a snapshot of
the weights this batch trains from, while it trains (sampling and training overlap, on
separate threads or machines); that batch is then one step stale, which the losses
correct with the sampler's logprobs. One batch is in flight, so the staleness is 1 for
any k >= 1; `staleness` is recorded per step. k = 0 is strictly on-policy.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tinker import types

from ember.metrics import MetricsConfig, get_logger, record_metric, span
from ember.recipes.common import RL_LOSSES, SCHEDULES, ClientConfig, Evaluator, Schedule, StepHook, learning_rate_at, rl_datum
from ember.recipes.env import Environment, Problem


@dataclass
class GRPOConfig:
    base_model: str = ""
    init_from: str = ""  # a tinker:// save_state path to start from (e.g. an SFT run); empty: fresh LoRA
    lora_rank: int = 32
    steps: int = 100
    prompts_per_step: int = 16  # P
    group_size: int = 8  # G
    max_tokens: int = 16
    temperature: float = 1.0
    learning_rate: float = 1e-4
    lr_schedule: Schedule = "constant"
    adam_beta2: float = 0.95  # Tinker's default; 0.999 smooths the noisy, sparse RL gradient
    loss_fn: Literal["importance_sampling", "ppo"] = "importance_sampling"
    clip_low: float = 0.8  # ppo ratio bounds (absolute, Tinker's convention)
    clip_high: float = 1.2
    minibatches: int = 1  # optimizer steps per batch
    max_staleness: int = 0  # k: sample from weights at most k steps old
    std_normalize: bool = False
    eval_every: int = 0  # steps between held-out evaluations (0: only the caller's)
    seed: int = 0
    env: str = "digit_sum"
    env_args: dict[str, Any] = field(default_factory=dict)
    run_dir: str = ""
    save_name: str = "final"
    client: ClientConfig = field(default_factory=ClientConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        for name in ("lora_rank", "steps", "prompts_per_step", "group_size", "max_tokens", "minibatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"GRPOConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.minibatches > self.prompts_per_step:
            raise ValueError(f"GRPOConfig.minibatches ({self.minibatches}) > prompts_per_step ({self.prompts_per_step})")
        if self.max_staleness < 0 or self.eval_every < 0 or self.temperature < 0:
            raise ValueError("GRPOConfig: max_staleness, eval_every and temperature must be >= 0")
        if self.loss_fn not in RL_LOSSES:
            raise ValueError(f"GRPOConfig.loss_fn must be one of {RL_LOSSES}, got {self.loss_fn!r}")
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(f"GRPOConfig.lr_schedule must be one of {SCHEDULES}, got {self.lr_schedule!r}")
        if not 0 <= self.clip_low <= 1 <= self.clip_high:
            raise ValueError(f"GRPOConfig: need 0 <= clip_low <= 1 <= clip_high, got {self.clip_low}, {self.clip_high}")


@dataclass
class Rollout:
    problem: Problem
    tokens: list[int]
    logprobs: list[float]
    reward: float


def submit_samples(
    sampling_client, problems: Sequence[Problem], n: int, params: types.SamplingParams,
    rng: random.Random | None = None,
) -> list:
    """One `sample` request per problem, all submitted before any is awaited.

    With `rng`, each request gets its own sampling seed (reproducible runs).
    """
    futures = []
    for p in problems:
        req_params = params if rng is None else params.model_copy(update={"seed": rng.randrange(2**31)})
        futures.append(sampling_client.sample(types.ModelInput.from_ints(list(p.tokens)), n, req_params))
    return futures


def collect_groups(env: Environment, problems: Sequence[Problem], futures: Sequence) -> list[list[Rollout]]:
    groups = []
    for problem, future in zip(problems, futures):
        seqs = future.result().sequences
        groups.append([Rollout(problem, list(s.tokens), list(s.logprobs or []), env.reward(problem, s.tokens))
                       for s in seqs])
    return groups


def group_advantages(rewards_G: Sequence[float], std_normalize: bool) -> list[float]:
    mean = sum(rewards_G) / len(rewards_G)
    adv = [r - mean for r in rewards_G]
    if std_normalize and len(rewards_G) > 1:
        std = statistics.pstdev(rewards_G)
        adv = [a / (std + 1e-6) for a in adv]
    return adv


def minibatch_datums(groups: Sequence[list[Rollout]], std_normalize: bool) -> list[types.Datum]:
    n_seqs = sum(len(g) for g in groups)
    datums = []
    for group in groups:
        advantages_G = group_advantages([r.reward for r in group], std_normalize)
        for rollout, adv in zip(group, advantages_G):
            if adv != 0.0 and rollout.tokens:
                datums.append(rl_datum(rollout.problem.tokens, rollout.tokens, rollout.logprobs, adv / n_seqs))
    return datums


def train_on_batch(training_client, groups: Sequence[list[Rollout]], cfg: GRPOConfig, lr: float) -> None:
    """`cfg.minibatches` optimizer steps over the batch's groups (split by group)."""
    loss_config = {"clip_low_threshold": cfg.clip_low, "clip_high_threshold": cfg.clip_high}
    bounds = [round(i * len(groups) / cfg.minibatches) for i in range(cfg.minibatches + 1)]
    for lo, hi in zip(bounds, bounds[1:]):
        datums = minibatch_datums(groups[lo:hi], cfg.std_normalize)
        if not datums:  # every group constant: no signal, no step
            record_metric("skipped_minibatches", 1, reduce="sum")
            continue
        fb = training_client.forward_backward(datums, cfg.loss_fn, loss_config if cfg.loss_fn == "ppo" else None)
        opt = training_client.optim_step(types.AdamParams(learning_rate=lr, beta2=cfg.adam_beta2))
        record_metric("loss", fb.result().metrics["loss:sum"], reduce="sum")
        opt.result()


def record_batch_metrics(groups: Sequence[list[Rollout]]) -> None:
    rollouts = [r for g in groups for r in g]
    record_metric("reward", sum(r.reward for r in rollouts) / len(rollouts))
    record_metric("reward_max", max(r.reward for r in rollouts), reduce="max")
    record_metric("frac_groups_constant", sum(len({r.reward for r in g}) == 1 for g in groups) / len(groups))
    record_metric("completion_tokens", sum(len(r.tokens) for r in rollouts) / len(rollouts))
    logps = [lp for r in rollouts for lp in r.logprobs]
    if logps:
        record_metric("sampler_nll", -sum(logps) / len(logps))


def evaluate_greedy(sampling_client, env: Environment, problems: Sequence[Problem], max_tokens: int) -> float:
    """Mean reward of greedy (temperature 0) completions: exact-match accuracy for 0/1 rewards."""
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=env.stop())
    groups = collect_groups(env, problems, submit_samples(sampling_client, problems, 1, params))
    return sum(g[0].reward for g in groups) / len(groups)


def train_grpo(
    training_client, env: Environment, cfg: GRPOConfig, on_step: StepHook | None = None,
    evaluate: Evaluator | None = None, prefix: str = "grpo/",
) -> Any:
    """Run `cfg.steps` GRPO steps; returns a sampling client of the final weights.

    Metrics are recorded as `<prefix><name>` and flushed once per step; `evaluate` runs
    every `cfg.eval_every` steps on a fresh snapshot.
    """
    rng, logger = random.Random(cfg.seed), get_logger()
    params = types.SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, stop=env.stop())

    def snapshot(step: int) -> tuple[Any, int]:
        with span("sync"):
            return training_client.save_weights_and_get_sampling_client().result(), step

    def submit(sampler: tuple[Any, int]) -> tuple[list[Problem], list, int]:
        problems = env.sample_problems(cfg.prompts_per_step, rng)
        return problems, submit_samples(sampler[0], problems, cfg.group_size, params, rng), sampler[1]

    with logger.prefix(prefix):
        sampler = snapshot(0)
        with span("sample"):
            pending: tuple | None = submit(sampler)
        for step in range(cfg.steps):
            problems, futures, version = pending
            with span("sample"):
                groups = collect_groups(env, problems, futures)
            pending = None
            if cfg.max_staleness > 0 and step + 1 < cfg.steps:
                if sampler[1] != step:
                    sampler = snapshot(step)  # the weights this batch trains from
                with span("sample"):
                    pending = submit(sampler)  # the next batch, sampled while this one trains
            lr = learning_rate_at(step, cfg.steps, cfg.learning_rate, cfg.lr_schedule)
            with span("train"):
                train_on_batch(training_client, groups, cfg, lr)
            record_batch_metrics(groups)
            record_metric("staleness", step - version, reduce="max")
            record_metric("lr", lr)
            last = step + 1 == cfg.steps
            wants_eval = evaluate is not None and cfg.eval_every > 0 and ((step + 1) % cfg.eval_every == 0 or last)
            if (pending is None and not last) or wants_eval:
                sampler = snapshot(step + 1)
            if pending is None and not last:
                with span("sample"):
                    pending = submit(sampler)
            if wants_eval:
                for key, value in evaluate(sampler[0], step + 1).items():
                    record_metric(key, value)
            summary = logger.flush(step)
            if on_step is not None:
                on_step(step, summary)
        return sampler[0] if sampler[1] == cfg.steps else snapshot(cfg.steps)[0]


def make_digit_sum_env(tokenizer, **kwargs: Any) -> Environment:
    from ember.recipes.digit_sum import DigitSumEnv, DigitSumTask

    return DigitSumEnv(DigitSumTask(tokenizer, **kwargs))


# name -> factory(tokenizer, **env_args); `ember train grpo --env NAME --env_args '{...}'`
ENVIRONMENTS: dict[str, Any] = {"digit_sum": make_digit_sum_env}


def run_grpo(config: GRPOConfig, on_step: StepHook | None = None) -> str | None:
    """Create (or restore) the training client, train, save; returns the saved path (or None)."""
    from ember.recipes.common import make_service_client

    if config.env not in ENVIRONMENTS:
        raise ValueError(f"GRPOConfig.env: unknown environment {config.env!r}; known: {sorted(ENVIRONMENTS)}")
    service_client = make_service_client(config.client)
    if config.init_from:
        training_client = service_client.create_training_client_from_state(config.init_from).result()
    else:
        training_client = service_client.create_lora_training_client(
            base_model=config.base_model, rank=config.lora_rank, seed=config.seed
        ).result()
    env = ENVIRONMENTS[config.env](training_client.get_tokenizer(), **config.env_args)
    train_grpo(training_client, env, config, on_step=on_step)
    if not config.save_name:
        return None
    return training_client.save_state(config.save_name).result().path
