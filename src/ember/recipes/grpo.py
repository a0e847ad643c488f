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

Asynchronous (`max_steps_off_policy = N > 0`, `train_grpo_async`): a rollout thread
(`ember.recipes.rl.offpolicy.RolloutWorker`) samples from an in-flight sampling client
(`kind="inflight"`) while this thread trains; each step ends with an in-flight save that the
thread's client follows. The groups for step r are sampled once the weights after step r - N
are published, so a group is at most N steps stale; `staleness` (max), `async/staleness_mean`
and `async/dropped_groups` (groups staler than N, left out: the gate keeps it 0) are recorded
per step. It does not checkpoint (its queued groups are in no saved state).

KL to a reference (`kl_coef` = beta > 0): the reward is shaped per token by the k1
estimator, k_t = log q(c_t) - log p_ref(c_t) on the sampled tokens, centred on the
mini-batch mean k-bar: completion token t of sequence i carries (A_i + beta*(k-bar - k_t)) / S
(tinker-cookbook's `incorporate_kl_penalty`), rather than a k3 term in the loss. Why:
(1) it works with every built-in loss (`importance_sampling`, `ppo`) unchanged, in process
and over HTTP; a k3 term needs a reference-logprob loss input that Tinker's losses lack (a
new loss name, or a second round trip through `forward_backward_custom`); (2) it needs
log p_ref only on the sampled tokens, which the reference sampler's `compute_logprobs`
returns (q_t are the sampler's logprobs, already at hand); (3) centring keeps the shaped
advantages' token-mean equal to the unshaped one, so the KL term moves no baseline. The
reference is a sampler of frozen weights (`kl_reference`: by default the policy's step-0
weights). Its logprobs for the whole batch are submitted before the policy trains and
each mini-batch awaits only its own just before building its datums, so the reference
runs while the policy trains. Groups of constant reward are kept (their KL term is a
signal). `kl_ref` (mean k1 over the batch's completion tokens: the measured KL) and
`kl_ref_k3` (mean exp(r)-1-r, r = -k1: >= 0, lower variance) are recorded per step.
kl_coef = 0 makes no reference call and sends exactly the datums it sent before.

Resume (`save_every`, `resume_from`; see `ember.recipes.resume`): every `save_every` steps
the loop saves the weights and optimizer (`save_state`) and writes `<run_dir>/checkpoint.json`
with the step, the RNG state, the batch already sampled for the next step (when sampling runs
ahead) and the KL reference's path. `resume_from = <that run_dir>` creates the policy from the
state with its optimizer and goes on from that step with the same RNG stream and the original
step-0 reference, so the resumed steps are those of an uninterrupted run (up to the
floating-point noise of which rows share a decode batch, which two uninterrupted runs show too).

No learning signal: a step in which every group's G samples got the same reward (and no KL
term) sends nothing and takes no optimizer step (`frac_groups_constant` 1,
`skipped_minibatches`). After `NO_SIGNAL_STEPS` such steps in a row the loop logs a warning
saying what to change, instead of "training" on in silence.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from tinker import types

from ember.config import to_dict
from ember.metrics import get_logger, record_metric, span
from ember.recipes.common import (
    RL_LOSSES,
    SCHEDULES,
    Evaluator,
    Schedule,
    StepHook,
    learning_rate_at,
    rl_datum,
)
from ember.recipes.resume import (
    Checkpoint,
    SavedBatch,
    check_same_run,
    completed_futures,
    random_from,
    read_checkpoint,
    samples_of,
    write_checkpoint,
)
from ember.recipes.rl.advantages import group_advantages, kl_k1, kl_k3, kl_shaped_advantages
from ember.recipes.rl.config import RLConfig
from ember.recipes.rl.env import Environment, Problem
from ember.recipes.rl.environments import check_env_name, make_env
from ember.recipes.rl.offpolicy import RolloutWorker, VersionedGroup
from ember.recipes.rl.reference import completion_logprobs, save_step0_reference, submit_reference_logprobs
from ember.recipes.rl.rollouts import Rollout, collect_groups, submit_samples

log = logging.getLogger(__name__)
NO_SIGNAL_STEPS = 3  # consecutive steps without an optimizer step before the warning


@dataclass
class GRPOConfig(RLConfig):
    group_size: int = 8  # G
    lr_schedule: Schedule = "constant"
    loss_fn: Literal["importance_sampling", "ppo"] = "importance_sampling"
    minibatches: int = 1  # optimizer steps per batch
    max_staleness: int = 0  # k: sample from weights at most k steps old
    # N: a rollout thread samples from an in-flight client at most N steps ahead of training (0: synchronous)
    max_steps_off_policy: int = 0
    std_normalize: bool = False
    # KL reference: "" = the policy's step-0 weights; a tinker://<run>/sampler_weights/<name> path; a base model name
    kl_reference: str = ""
    eval_every: int = 0  # steps between held-out evaluations (0: only the caller's)
    save_every: int = 0  # steps between resumable checkpoints (save_state + <run_dir>/checkpoint.json); 0: none
    resume_from: str = ""  # the run_dir of a run with save_every > 0: go on from its last checkpoint

    AT_LEAST_ONE = (*RLConfig.AT_LEAST_ONE, "group_size", "minibatches")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.save_every < 0:
            raise ValueError(f"GRPOConfig.save_every must be >= 0 (0: no checkpoints), got {self.save_every}")
        if self.minibatches > self.prompts_per_step:
            raise ValueError(f"GRPOConfig.minibatches ({self.minibatches}) > prompts_per_step ({self.prompts_per_step})")
        if self.max_staleness < 0 or self.eval_every < 0 or self.temperature < 0:
            raise ValueError("GRPOConfig: max_staleness, eval_every and temperature must be >= 0")
        self._check_async()
        if self.loss_fn not in RL_LOSSES:
            raise ValueError(f"GRPOConfig.loss_fn must be one of {RL_LOSSES}, got {self.loss_fn!r}")
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(f"GRPOConfig.lr_schedule must be one of {SCHEDULES}, got {self.lr_schedule!r}")
        self._check_kl()

    def _check_async(self) -> None:
        n = self.max_steps_off_policy
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"GRPOConfig.max_steps_off_policy must be an int >= 0 (0: synchronous), "
                             f"got {n!r}")
        if n == 0:
            return
        if self.max_staleness > 0:
            raise ValueError(f"GRPOConfig: max_steps_off_policy ({n}) and max_staleness ({self.max_staleness}) are "
                             "two ways to sample ahead; set one (max_staleness: one batch from a snapshot, "
                             "resumable; max_steps_off_policy: a rollout thread on in-flight weights)")
        if self.save_every > 0 or self.resume_from:
            raise ValueError("GRPOConfig.max_steps_off_policy > 0 does not checkpoint (the rollout thread's "
                             "queued groups are in no saved state); set save_every = 0 and resume_from = '', "
                             "or use max_staleness for a resumable off-policy run")

    def _check_kl(self) -> None:
        if isinstance(self.kl_coef, bool) or not isinstance(self.kl_coef, (int, float)) \
                or not math.isfinite(self.kl_coef) or self.kl_coef < 0:
            raise ValueError(f"GRPOConfig.kl_coef must be a finite number >= 0, got {self.kl_coef!r}")
        ref = self.kl_reference
        if not isinstance(ref, str):
            raise ValueError(f"GRPOConfig.kl_reference must be a string, got {type(ref).__name__}")
        if ref and self.kl_coef == 0:
            raise ValueError(f"GRPOConfig.kl_reference is {ref!r} but kl_coef is 0, so no reference is used; "
                             "set kl_coef > 0 or leave kl_reference empty")
        if ref and not (KL_REFERENCE_PATH.fullmatch(ref) or KL_REFERENCE_NAME.fullmatch(ref)):
            raise ValueError(f"GRPOConfig.kl_reference must be '' (the policy's step-0 weights), a "
                             f"tinker://<run>/sampler_weights/<name> (or .../weights/<name>) path or a base model "
                             f"name, got {ref!r}")


# kl_reference spellings: a sampler (or state) checkpoint path, or a base model name ("Qwen/Qwen3-8B", "tiny").
KL_REFERENCE_PATH = re.compile(r"tinker://[^/\s]+/(sampler_weights|weights)/[^/\s]+")
KL_REFERENCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]*(/[A-Za-z0-9][A-Za-z0-9._\-]*)?")


def minibatch_datums(groups: Sequence[list[Rollout]], std_normalize: bool, kl_coef: float = 0.0) -> list[types.Datum]:
    n_seqs = sum(len(g) for g in groups)
    if kl_coef > 0:
        return kl_minibatch_datums(groups, std_normalize, kl_coef, n_seqs)
    datums = []
    for group in groups:
        advantages_G = group_advantages([r.reward for r in group], std_normalize)
        for rollout, adv in zip(group, advantages_G):
            if adv != 0.0 and rollout.tokens:
                datums.append(rl_datum(rollout.problem.tokens, rollout.tokens, rollout.logprobs, adv / n_seqs))
    return datums


def kl_minibatch_datums(
    groups: Sequence[list[Rollout]], std_normalize: bool, kl_coef: float, n_seqs: int,
) -> list[types.Datum]:
    """Datums with KL-shaped per-token advantages (A_i + beta*(k-bar - k_t)) / S; every
    non-empty rollout is sent, constant-reward groups included (their KL term is a signal)."""
    rollouts, advantages_N = [], []
    for group in groups:
        for rollout, adv in zip(group, group_advantages([r.reward for r in group], std_normalize)):
            if rollout.tokens:
                rollouts.append(rollout)
                advantages_N.append(adv)
    if any(r.ref_logprobs is None for r in rollouts):
        raise RuntimeError("kl_minibatch_datums: a rollout has no reference logprobs (await them first)")
    shaped_N_T = kl_shaped_advantages(advantages_N, [r.logprobs for r in rollouts],
                                      [r.ref_logprobs for r in rollouts], kl_coef)
    return [rl_datum(r.problem.tokens, r.tokens, r.logprobs, [a / n_seqs for a in shaped_T])
            for r, shaped_T in zip(rollouts, shaped_N_T)]


def submit_group_references(reference, groups: Sequence[list[Rollout]]) -> list[list]:
    """The reference's logprobs of every non-empty rollout, all submitted before any is awaited."""
    sequences = [(r.problem.tokens, r.tokens) for g in groups for r in g if r.tokens]
    futures = submit_reference_logprobs(reference, sequences)
    it = iter(futures)
    return [[next(it) if r.tokens else None for r in g] for g in groups]


def await_references(groups: Sequence[list[Rollout]], futures_G: Sequence[list]) -> None:
    """Fill `ref_logprobs` of the given groups' rollouts from their reference futures."""
    for group, futures in zip(groups, futures_G):
        for rollout, future in zip(group, futures):
            if future is not None:
                rollout.ref_logprobs = completion_logprobs(future.result(), len(rollout.problem.tokens),
                                                           len(rollout.tokens))


def record_kl_metrics(groups: Sequence[list[Rollout]]) -> None:
    """`kl_ref`: mean k1 over the batch's completion tokens (the measured KL to the reference);
    `kl_ref_k3`: mean k3 over the same tokens."""
    rollouts = [r for g in groups for r in g if r.tokens and r.ref_logprobs is not None]
    k1 = [k for r in rollouts for k in kl_k1(r.logprobs, r.ref_logprobs)]
    if k1:
        record_metric("kl_ref", sum(k1) / len(k1))
        k3 = [k for r in rollouts for k in kl_k3(r.logprobs, r.ref_logprobs)]
        record_metric("kl_ref_k3", sum(k3) / len(k3))


# (a mini-batch's groups, the datums made of them): what a caller records of each, e.g. to check the datums
MinibatchHook = Callable[[Sequence[list[Rollout]], list[types.Datum]], None]


def train_on_batch(
    training_client, groups: Sequence[list[Rollout]], cfg: GRPOConfig, lr: float, reference: Any = None,
    on_minibatch: MinibatchHook | None = None,
) -> int:
    """`cfg.minibatches` optimizer steps over the batch's groups (split by group); returns
    how many were taken (mini-batches whose groups all have constant reward are skipped).
    `on_minibatch` sees each mini-batch's groups and datums (a skipped one's too).

    With `cfg.kl_coef > 0`, the reference's logprobs of the whole batch are submitted
    first; each mini-batch awaits only its own, so the reference works while the policy trains.
    """
    loss_config = {"clip_low_threshold": cfg.clip_low, "clip_high_threshold": cfg.clip_high}
    bounds = [round(i * len(groups) / cfg.minibatches) for i in range(cfg.minibatches + 1)]
    ref_futures = submit_group_references(reference, groups) if cfg.kl_coef > 0 else None
    taken = 0
    for lo, hi in zip(bounds, bounds[1:]):
        if ref_futures is not None:
            with span("reference"):
                await_references(groups[lo:hi], ref_futures[lo:hi])
        datums = minibatch_datums(groups[lo:hi], cfg.std_normalize, cfg.kl_coef)
        if on_minibatch is not None:
            on_minibatch(groups[lo:hi], datums)
        if not datums:  # every group constant: no signal, no step
            record_metric("skipped_minibatches", 1, reduce="sum")
            continue
        fb = training_client.forward_backward(datums, cfg.loss_fn, loss_config if cfg.loss_fn == "ppo" else None)
        opt = training_client.optim_step(types.AdamParams(learning_rate=lr, beta2=cfg.adam_beta2))
        record_metric("loss", fb.result().metrics["loss:sum"], reduce="sum")
        opt.result()
        taken += 1
    if ref_futures is not None:
        record_kl_metrics(groups)
    return taken


def warn_no_signal(streak: int, cfg: GRPOConfig) -> None:
    """Once a streak of steps without an optimizer step reaches NO_SIGNAL_STEPS: say what to change."""
    if streak != NO_SIGNAL_STEPS:
        return
    log.warning(
        "GRPO: no learning signal for %d steps in a row: every group's %d samples got the same reward "
        "(frac_groups_constant 1), so no optimizer step ran. The policy almost never (or always) earns the "
        "reward; make rewards differ within a group: start from a model that sometimes succeeds (init_from "
        "an SFT checkpoint), give partial credit (env_args = {partial_credit = true} for digit_sum), raise "
        "group_size or temperature (now %g), or use kl_coef > 0.", streak, cfg.group_size, cfg.temperature)


def record_batch_metrics(groups: Sequence[list[Rollout]]) -> None:
    rollouts = [r for g in groups for r in g]
    record_metric("reward", sum(r.reward for r in rollouts) / len(rollouts))
    record_metric("reward_max", max(r.reward for r in rollouts), reduce="max")
    record_metric("frac_groups_constant", sum(len({r.reward for r in g}) == 1 for g in groups) / len(groups))
    record_metric("completion_tokens", sum(len(r.tokens) for r in rollouts) / len(rollouts))
    logps = [lp for r in rollouts for lp in r.logprobs]
    if logps:
        record_metric("sampler_nll", -sum(logps) / len(logps))


def make_reference(service_client, kl_reference: str) -> Any:
    """The sampler named by `GRPOConfig.kl_reference` (a tinker:// path or a base model name)."""
    kwargs = {"model_path": kl_reference} if kl_reference.startswith("tinker://") else {"base_model": kl_reference}
    try:
        return service_client.create_sampling_client(**kwargs).result()
    except Exception as e:  # the service's own words (unknown model, missing checkpoint) name what is wrong
        raise ValueError(f"GRPOConfig.kl_reference {kl_reference!r}: no reference sampler can be made from it: "
                         f"{type(e).__name__}: {e}") from e


class PolicySnapshot(NamedTuple):
    """A sampling client of the policy and the number of optimizer steps its weights have seen."""

    client: Any
    version: int


class Batch(NamedTuple):
    """One step's problems and their `sample` futures (one per problem, G sequences each)."""

    problems: list[Problem]
    futures: list
    version: int  # the weights version it is sampled from (staleness = step - version)
    rng_state: tuple  # the RNG before the batch drew its problems and seeds (what a checkpoint replays)


class Snapshots:
    """The policy's latest sampler snapshot; a new one only when asked for another weights version."""

    def __init__(self, training_client) -> None:
        self.training_client = training_client
        self.latest: PolicySnapshot | None = None

    def at(self, version: int) -> PolicySnapshot:
        if self.latest is None or self.latest.version != version:
            with span("sync"):
                self.latest = PolicySnapshot(self.training_client.save_weights_and_get_sampling_client().result(), version)
        return self.latest


def sample_batch(sampler: PolicySnapshot, env: Environment, cfg: GRPOConfig, params: types.SamplingParams,
                 rng: random.Random) -> Batch:
    """Draw P problems and submit G samples of each; nothing is awaited."""
    rng_state = rng.getstate()
    with span("sample"):
        problems = env.sample_problems(cfg.prompts_per_step, rng)
        futures = submit_samples(sampler.client, problems, cfg.group_size, params, rng)
    return Batch(problems, futures, sampler.version, rng_state)


def train_grpo(
    training_client, env: Environment, cfg: GRPOConfig, on_step: StepHook | None = None,
    evaluate: Evaluator | None = None, prefix: str = "grpo/", reference: Any = None,
    checkpoint: Checkpoint | None = None, on_minibatch: MinibatchHook | None = None,
) -> Any:
    """Run GRPO steps up to `cfg.steps`; returns a sampling client of the final weights.

    Metrics are recorded as `<prefix><name>` and flushed once per step; `evaluate` runs
    every `cfg.eval_every` steps on a fresh snapshot. `reference` (a sampling client) is the
    KL reference when `cfg.kl_coef > 0`; None: the policy's weights at step 0. `checkpoint`
    (`load_checkpoint(cfg)`, with a training client created from its `state_path` with the
    optimizer, as `run_grpo` does) resumes a run from its step. `on_minibatch`: `train_on_batch`'s.
    """
    check_resume_settings(cfg, checkpoint)
    reference, reference_path = kl_reference_for(training_client, cfg, reference, checkpoint)
    if cfg.max_steps_off_policy > 0:
        return train_grpo_async(training_client, env, cfg, on_step, evaluate, prefix, reference)
    start, rng, batch = start_point(cfg, env, checkpoint)
    params = types.SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, stop=env.stop())
    snapshots, logger, no_signal = Snapshots(training_client), get_logger(), 0
    with logger.prefix(prefix):
        for step in range(start, cfg.steps):
            last = step + 1 == cfg.steps
            if batch is None:  # on-policy (and the first step): sampled now, from the weights about to train
                batch = sample_batch(snapshots.at(step), env, cfg, params, rng)
            with span("sample"):
                groups = collect_groups(env, batch.problems, batch.futures)
            next_batch = None
            if cfg.max_staleness > 0 and not last:  # sampled while this batch trains, from the weights it trains
                next_batch = sample_batch(snapshots.at(step), env, cfg, params, rng)
            lr = learning_rate_at(step, cfg.steps, cfg.learning_rate, cfg.lr_schedule)
            with span("train"):
                no_signal = 0 if train_on_batch(training_client, groups, cfg, lr, reference, on_minibatch) else no_signal + 1
            warn_no_signal(no_signal, cfg)
            record_batch_metrics(groups)
            record_metric("staleness", step - batch.version, reduce="max")
            record_metric("lr", lr)
            evaluate_at(step, cfg, evaluate, snapshots)
            if cfg.save_every > 0 and (step + 1) % cfg.save_every == 0:
                save_checkpoint(training_client, cfg, step + 1, rng, next_batch, reference_path)
            summary = logger.flush(step)
            if on_step is not None:
                on_step(step, summary)
            batch = next_batch
        return snapshots.at(cfg.steps).client


def evaluate_at(step: int, cfg: GRPOConfig, evaluate: Evaluator | None, snapshots: Snapshots) -> None:
    """Every `cfg.eval_every` steps and after the last: `evaluate` on a snapshot of the weights after `step`."""
    if evaluate is None or cfg.eval_every <= 0 or ((step + 1) % cfg.eval_every != 0 and step + 1 != cfg.steps):
        return
    for key, value in evaluate(snapshots.at(step + 1).client, step + 1).items():
        record_metric(key, value)


def record_staleness(step: int, taken: Sequence[VersionedGroup], dropped: int) -> None:
    """`staleness`: the step's largest (step - version) over its groups; `async/staleness_mean` its mean;
    `async/dropped_groups`: groups left out for being more than max_steps_off_policy steps stale."""
    stale_G = [step - g.version for g in taken]
    record_metric("staleness", max(stale_G), reduce="max")
    record_metric("async/staleness_mean", sum(stale_G) / len(stale_G))
    record_metric("async/dropped_groups", dropped, reduce="sum")


def train_grpo_async(
    training_client, env: Environment, cfg: GRPOConfig, on_step: StepHook | None, evaluate: Evaluator | None,
    prefix: str, reference: Any,
) -> Any:
    """`train_grpo` with `cfg.max_steps_off_policy` = N > 0: a `RolloutWorker` thread samples from an
    in-flight sampling client while this thread trains; after each step an in-flight save publishes the
    new weights to it (see `ember.recipes.rl.offpolicy`). Returns a sampling client of the final weights."""
    params = types.SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, stop=env.stop())
    snapshots, logger, no_signal = Snapshots(training_client), get_logger(), 0
    with span("sync"):
        inflight = training_client.save_weights_and_get_sampling_client(kind="inflight").result()
    worker = RolloutWorker(inflight, env, cfg.prompts_per_step, cfg.group_size, params, random.Random(cfg.seed),
                           cfg.max_steps_off_policy)
    with logger.prefix(prefix), worker:
        for step in range(cfg.steps):
            with span("sample"):  # waiting for the rollout thread: ~0 when sampling keeps ahead
                taken, dropped = worker.take(cfg.prompts_per_step, step)
            groups = [g.group for g in taken]
            lr = learning_rate_at(step, cfg.steps, cfg.learning_rate, cfg.lr_schedule)
            with span("train"):
                no_signal = 0 if train_on_batch(training_client, groups, cfg, lr, reference) else no_signal + 1
            warn_no_signal(no_signal, cfg)
            if step + 1 < cfg.steps:
                with span("sync"):
                    training_client.save_weights_and_get_sampling_client(kind="inflight").result()
                worker.publish(step + 1)
            record_batch_metrics(groups)
            record_staleness(step, taken, dropped)
            record_metric("lr", lr)
            evaluate_at(step, cfg, evaluate, snapshots)
            summary = logger.flush(step)
            if on_step is not None:
                on_step(step, summary)
    return snapshots.at(cfg.steps).client


# ---------------------------------------------------------------------------- resume

# Fields a resumed run may change; every other field shapes the run and must be the checkpoint's.
# (`steps` may grow or shrink; a decaying lr_schedule then decays over the new count.)
RESUMABLE_CHANGES = frozenset({"steps", "eval_every", "save_every", "save_name", "run_dir", "resume_from",
                               "client", "metrics"})


def run_identity(cfg: GRPOConfig) -> dict[str, Any]:
    """The config fields that shape the run, as JSON values (what a checkpoint records)."""
    return json.loads(json.dumps({k: v for k, v in to_dict(cfg).items() if k not in RESUMABLE_CHANGES}))


def load_checkpoint(cfg: GRPOConfig) -> Checkpoint:
    """The checkpoint in `cfg.resume_from`, checked against `cfg` (same run, a step within `steps`)."""
    checkpoint = read_checkpoint(cfg.resume_from, "grpo", "GRPOConfig.resume_from")
    check_same_run(checkpoint, run_identity(cfg), RESUMABLE_CHANGES, cfg.steps,
                   f"GRPOConfig.resume_from {cfg.resume_from!r}")
    return checkpoint


def check_resume_settings(cfg: GRPOConfig, checkpoint: Checkpoint | None) -> None:
    if cfg.save_every > 0 and not cfg.run_dir:
        raise ValueError(f"GRPOConfig.save_every is {cfg.save_every} but run_dir is empty: checkpoints are "
                         "written to run_dir; set one")
    if cfg.resume_from and checkpoint is None:
        raise ValueError("GRPOConfig.resume_from is set but train_grpo got no checkpoint: pass "
                         "checkpoint=load_checkpoint(cfg) and a training client created from its state_path with "
                         "the optimizer (run_grpo does both)")


def kl_reference_for(
    training_client, cfg: GRPOConfig, reference: Any, checkpoint: Checkpoint | None,
) -> tuple[Any, str]:
    """The KL reference and the path a checkpoint records for it ("" when none or the caller's).

    A resumed run samples from the reference its first run made (the weights at step 0),
    not from the weights it resumes with."""
    if cfg.kl_coef == 0 or reference is not None:
        return reference, ""
    if checkpoint is None:
        path = save_step0_reference(training_client)
    elif checkpoint.reference_path:
        path = checkpoint.reference_path
    else:
        raise ValueError("GRPOConfig.resume_from: the checkpoint's run was given its KL reference by its caller "
                         "(none is recorded); pass the same reference to train_grpo")
    return training_client.create_sampling_client(path).result(), path


def start_point(
    cfg: GRPOConfig, env: Environment, checkpoint: Checkpoint | None,
) -> tuple[int, random.Random, Batch | None]:
    """The first step, the RNG and the batch already sampled for that step: step 0, `Random(seed)`
    and none; or the checkpoint's."""
    rng = random.Random(cfg.seed)
    if checkpoint is None:
        return 0, rng, None
    rng.setstate(checkpoint.rng_state)
    batch = None if checkpoint.batch is None else restore_batch(checkpoint.batch, env, cfg.prompts_per_step)
    return checkpoint.step, rng, batch


def restore_batch(saved: SavedBatch, env: Environment, n_problems: int) -> Batch:
    """The saved batch: its problems drawn again from the RNG state they were drawn with, its samples
    as completed futures."""
    problems = env.sample_problems(n_problems, random_from(saved.rng_state))
    if len(problems) != len(saved.samples):
        raise ValueError(f"GRPOConfig.resume_from: the checkpoint's batch has samples of {len(saved.samples)} "
                         f"problems, the environment drew {len(problems)} (expected prompts_per_step = {n_problems})")
    return Batch(problems, completed_futures(saved.samples), saved.version, saved.rng_state)


def save_checkpoint(training_client, cfg: GRPOConfig, done: int, rng: random.Random, next_batch: Batch | None,
                    reference_path: str) -> None:
    """save_state (weights + optimizer) after `done` steps, then `<run_dir>/checkpoint.json` naming it.

    A batch already sampled for the next step is awaited and its samples kept: the weights it
    was sampled from (one step behind) are in no saved state."""
    with span("save"):
        state_path = training_client.save_state(f"grpo-step-{done:06d}").result().path
        saved = None
        if next_batch is not None:
            saved = SavedBatch(next_batch.version, next_batch.rng_state, samples_of(next_batch.futures))
        write_checkpoint(cfg.run_dir, Checkpoint("grpo", done, state_path, rng.getstate(), run_identity(cfg),
                                                 reference_path, saved))


def create_policy(service_client, cfg: GRPOConfig, checkpoint: Checkpoint | None) -> Any:
    """The policy's training client: the checkpoint's state with its optimizer, `init_from`, or a fresh LoRA."""
    if checkpoint is not None:
        return service_client.create_training_client_from_state_with_optimizer(checkpoint.state_path).result()
    if cfg.init_from:
        return service_client.create_training_client_from_state(cfg.init_from).result()
    return service_client.create_lora_training_client(base_model=cfg.base_model, rank=cfg.lora_rank,
                                                      seed=cfg.seed).result()


def run_grpo(config: GRPOConfig, on_step: StepHook | None = None) -> str | None:
    """Create (restore, or resume) the training client, train, save; returns the saved path (or None)."""
    from ember.recipes.common import make_service_client

    check_env_name(config.env, "GRPOConfig")
    checkpoint = load_checkpoint(config) if config.resume_from else None  # bad input fails before any model loads
    with make_service_client(config.client) as service_client:  # closed at the end: an open SDK client heartbeats
        training_client = create_policy(service_client, config, checkpoint)
        reference = make_reference(service_client, config.kl_reference) if config.kl_reference else None
        env = make_env(config.env, training_client.get_tokenizer(), config.env_args)
        train_grpo(training_client, env, config, on_step=on_step, reference=reference, checkpoint=checkpoint)
        if not config.save_name:
            return None
        return training_client.save_state(config.save_name).result().path
