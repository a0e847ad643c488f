"""PPO with a critic, flat, on the public Tinker API only.

Roles are training runs, not engine subclasses: the policy is a LoRA run; the critic is a
value-head run (`user_metadata={"ember.head": "value"}`) whose per-token outputs (read
from `loss_fn_outputs[i]["logprobs"]`) are values; the reference is a sampler of the
policy's step-0 weights (saved, so it outlives snapshot eviction; immutable, contract 4)
asked for `compute_logprobs`; the optional reward model
is a value-head run restored from its `save_state` path (`reward_model.py`), whose value
at the last position scores a whole sequence.

Per step (B = P*G rollouts): sample from the policy's snapshot; role forwards -- critic
values, reference logprobs (kl_coef > 0), reward-model scores (reward_model set) -- all
SUBMITTED before any is AWAITED, so they run together wherever they live on different
lanes (`overlap=False` awaits each at once, for the benchmark); per-token rewards
r_t = -kl_coef*(log q_t - log ref_t), plus the task reward at the last token; GAE(gamma,
lambda) with V_T = 0 after the completion's last token (a truncated completion is treated
as terminal too); returns R = A + V; optional whitening of A over the batch; `epochs` x
`minibatches` of the policy's `ppo` loss and the critic's `ppo_value` loss, both submitted
before either is awaited; then a new policy snapshot.

Normalisation (docs/architecture.md contract 1: losses are sums): within a mini-batch of n completion
tokens every policy advantage is divided by n and every critic weight is 1/n, so both
losses are token means and the LR does not depend on the batch size.

Where overlap happens: a LoRA critic (default) on the policy's base shares the policy's
single training lane (one PeftModel, adapters switched per run), so critic and policy
forwards/updates serialise and only the samplers (rollouts, reference) run beside them;
a full-FT critic (`critic_full_ft = true`) has its own lane, so its forwards and updates
overlap with the policy's; a critic on another ember (`critic_client`: a second `ember serve`
on other devices, or another in-process service) runs beside the policy too.
"""

from __future__ import annotations

import contextlib
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tinker import types

from ember.metrics import get_logger, record_metric, span
from ember.recipes.common import ClientConfig, StepHook, rl_datum
from ember.recipes.rl.advantages import gae, kl_k1, token_rewards, whiten
from ember.recipes.rl.config import RLConfig
from ember.recipes.rl.env import Environment
from ember.recipes.rl.environments import check_env_name, make_env
from ember.recipes.rl.reference import completion_logprobs, step0_reference, submit_reference_logprobs
from ember.recipes.rl.rollouts import Rollout, collect_groups, submit_samples

VALUE_HEAD = {"ember.head": "value"}  # user_metadata of a critic / reward-model run


@dataclass
class PPOConfig(RLConfig):
    steps: int = 50
    critic_lora_rank: int = 32
    critic_full_ft: bool = False  # full FT: its own lane, so it overlaps with the policy
    critic_init_from: str = ""  # a value-head save_state path; empty: fresh critic
    reward_model: str = ""  # a value-head save_state path (reward_model.py); empty: the env's reward
    samples_per_prompt: int = 1  # G
    critic_learning_rate: float = 1e-4
    gamma: float = 1.0
    lam: float = 0.95
    epochs: int = 2
    minibatches: int = 2  # per epoch, split by rollout
    value_clip: float = 0.2  # ppo_value: V is kept within old V +- value_clip
    whiten_advantages: bool = True
    overlap: bool = True  # submit role forwards / updates together (False: await each at once)
    # Another ember (other devices: a second `ember serve`, or another in-process service) for the
    # critic, so its forwards and updates run beside the policy's; empty: the policy's client.
    critic_client: ClientConfig = field(default_factory=ClientConfig)
    critic_base_model: str = ""  # the critic's base model name there (same tokenizer); empty: base_model

    AT_LEAST_ONE = (*RLConfig.AT_LEAST_ONE, "critic_lora_rank", "samples_per_prompt", "epochs", "minibatches")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.minibatches > self.prompts_per_step * self.samples_per_prompt:
            raise ValueError(f"PPOConfig.minibatches ({self.minibatches}) > rollouts per step "
                             f"({self.prompts_per_step * self.samples_per_prompt})")
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"PPOConfig.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.kl_coef < 0 or self.temperature < 0 or self.value_clip <= 0:
            raise ValueError(f"PPOConfig: need kl_coef >= 0, temperature >= 0, value_clip > 0; got "
                             f"{self.kl_coef}, {self.temperature}, {self.value_clip}")


# ---------------------------------------------------------------- pure helpers
def explained_variance(pred: Sequence[float], target: Sequence[float]) -> float:
    """1 - Var(target - pred) / Var(target); nan when the target is constant."""
    var_t = statistics.pvariance(target)
    if var_t == 0.0:
        return math.nan
    return 1.0 - statistics.pvariance([y - p for y, p in zip(target, pred, strict=True)]) / var_t


def value_datum(prompt: Sequence[int], completion: Sequence[int], returns_T: Sequence[float] | None = None,
                old_values_T: Sequence[float] | None = None, weight: float = 1.0) -> types.Datum:
    """A critic datum, aligned like `rl_datum`: position len(prompt)-1+t reads the state before
    completion token t, so V_t and log pi(c_t) share an index. `target_tokens` are sent because
    the SDK needs them (a value head ignores them); prompt positions carry weight 0. Without
    returns it is a forward (`cross_entropy`) datum; with returns and old values a `ppo_value` one."""
    if not prompt or not completion:
        raise ValueError(f"value_datum: need a prompt and a completion, got {len(prompt)} and {len(completion)} tokens")
    tokens, pad = [*prompt, *completion], [0.0] * (len(prompt) - 1)
    inputs: dict[str, Any] = {"target_tokens": tokens[1:], "weights": pad + [float(weight)] * len(completion)}
    for key, seq in (("returns", returns_T), ("old_values", old_values_T)):
        if seq is not None:
            if len(seq) != len(completion):
                raise ValueError(f"value_datum: {len(seq)} {key} for {len(completion)} completion tokens")
            data = pad + [float(x) for x in seq]  # an explicit TensorData: the SDK knows no dtype for these keys
            inputs[key] = types.TensorData(data=data, dtype="float32", shape=[len(data)])
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def score_datum(tokens: Sequence[int]) -> types.Datum:
    """A reward-model datum: the whole sequence as input, so the last position's value reads all of
    it (the score); `target_tokens` (zeros) and zero weights only satisfy the SDK's forward."""
    if len(tokens) < 1:
        raise ValueError("score_datum: need at least one token")
    zeros = [0] * len(tokens)
    return types.Datum(model_input=types.ModelInput.from_ints(list(tokens)),
                       loss_fn_inputs={"target_tokens": zeros, "weights": [0.0] * len(tokens)})


def completion_values(output: Any, prompt_len: int) -> list[float]:
    """V_t, t = 0..T-1, from one datum's forward output (a value head's `logprobs`)."""
    return [float(x) for x in output["logprobs"].data[prompt_len - 1:]]


# ---------------------------------------------------------------- one step
@dataclass
class Experience:
    rollout: Rollout
    values: list[float]  # critic's V before the update
    reward: float  # task (or reward-model) reward of the whole completion
    ref_logprobs: list[float] | None = None
    advantages: list[float] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)


def _await(pending: Any) -> Any:
    if isinstance(pending, list):
        return [_await(x) for x in pending]
    return pending.result() if hasattr(pending, "result") else pending


def role_forwards(rollouts: Sequence[Rollout], critic, reference=None, reward_model=None,
                  overlap: bool = True) -> list[Experience]:
    """Critic values, reference logprobs and reward-model scores for the rollouts: every request is
    submitted before any is awaited (`overlap=False`: each is awaited as soon as it is submitted)."""
    pending: dict[str, Any] = {}

    def submit(name: str, fn) -> None:
        pending[name] = fn() if overlap else _await(fn())

    submit("values", lambda: critic.forward([value_datum(r.problem.tokens, r.tokens) for r in rollouts],
                                            "cross_entropy"))
    if reference is not None:
        submit("ref", lambda: submit_reference_logprobs(reference, [(r.problem.tokens, r.tokens) for r in rollouts]))
    if reward_model is not None:
        submit("score", lambda: reward_model.forward([score_datum([*r.problem.tokens, *r.tokens]) for r in rollouts],
                                                     "cross_entropy"))
    done = {name: _await(p) for name, p in pending.items()}
    values = done["values"].loss_fn_outputs
    scores = [out["logprobs"].data[-1] for out in done["score"].loss_fn_outputs] if reward_model is not None else None
    out = []
    for i, r in enumerate(rollouts):
        ref = None if reference is None else completion_logprobs(done["ref"][i], len(r.problem.tokens), len(r.tokens))
        out.append(Experience(r, completion_values(values[i], len(r.problem.tokens)),
                              r.reward if scores is None else float(scores[i]), ref))
    return out


def compute_advantages(exps: Sequence[Experience], cfg: PPOConfig) -> None:
    """Per-token rewards, GAE and returns in place; whitening of A over all completion tokens."""
    for e in exps:
        r_T = token_rewards(e.reward, e.rollout.logprobs, e.ref_logprobs, cfg.kl_coef)
        e.advantages, e.returns = gae(r_T, e.values, cfg.gamma, cfg.lam)
    flat = [a for e in exps for a in e.advantages]
    record_metric("adv_mean", statistics.fmean(flat))
    record_metric("adv_std", statistics.pstdev(flat))
    if cfg.whiten_advantages and len(flat) > 1:
        white, k = whiten(flat), 0
        for e in exps:
            e.advantages, k = white[k:k + len(e.advantages)], k + len(e.advantages)


def update(policy, critic, exps: Sequence[Experience], cfg: PPOConfig, rng: random.Random,
           overlap: bool = True) -> None:
    """`epochs` x `minibatches` policy (`ppo`) and critic (`ppo_value`) steps on token means."""
    ppo_cfg = {"clip_low_threshold": cfg.clip_low, "clip_high_threshold": cfg.clip_high}
    adam_p = types.AdamParams(learning_rate=cfg.learning_rate, beta2=cfg.adam_beta2)
    adam_c = types.AdamParams(learning_rate=cfg.critic_learning_rate, beta2=cfg.adam_beta2)
    for _ in range(cfg.epochs):
        order = list(range(len(exps)))
        rng.shuffle(order)
        bounds = [round(i * len(order) / cfg.minibatches) for i in range(cfg.minibatches + 1)]
        for lo, hi in zip(bounds, bounds[1:]):
            mb = [exps[i] for i in order[lo:hi]]
            n = sum(len(e.rollout.tokens) for e in mb)
            pol = [rl_datum(e.rollout.problem.tokens, e.rollout.tokens, e.rollout.logprobs,
                            [a / n for a in e.advantages]) for e in mb]
            val = [value_datum(e.rollout.problem.tokens, e.rollout.tokens, e.returns, e.values, weight=1.0 / n)
                   for e in mb]
            futures = [policy.forward_backward(pol, "ppo", ppo_cfg), policy.optim_step(adam_p)]
            if not overlap:
                futures = _await(futures)
            futures += [critic.forward_backward(val, "ppo_value", {"value_clip": cfg.value_clip}),
                        critic.optim_step(adam_c)]
            fb_p, opt_p, fb_c, _ = _await(futures)
            record_metric("policy_loss", fb_p.metrics["loss:sum"])
            record_metric("clip_frac", fb_p.metrics.get("clipped_tokens:sum", 0.0) / n)
            record_metric("grad_norm", opt_p.metrics.get("grad_norm:mean", 0.0) if opt_p.metrics else 0.0)
            record_metric("value_loss", fb_c.metrics["loss:sum"])


def record_step_metrics(exps: Sequence[Experience]) -> None:
    record_metric("reward", sum(e.reward for e in exps) / len(exps))
    record_metric("task_reward", sum(e.rollout.reward for e in exps) / len(exps))
    record_metric("completion_tokens", sum(len(e.rollout.tokens) for e in exps) / len(exps))
    ev = explained_variance([v for e in exps for v in e.values], [r for e in exps for r in e.returns])
    if math.isfinite(ev):
        record_metric("explained_variance", ev)
    if all(e.ref_logprobs is not None for e in exps):
        k1 = [k for e in exps for k in kl_k1(e.rollout.logprobs, e.ref_logprobs)]
        record_metric("kl_ref", sum(k1) / len(k1))


def train_ppo(policy, critic, env: Environment, cfg: PPOConfig, reward_model=None, reference=None,
              on_step: StepHook | None = None, prefix: str = "ppo/") -> Any:
    """Run `cfg.steps` PPO steps; returns a sampling client of the final policy weights.

    `reference` (a sampling client) is the KL reference when `cfg.kl_coef > 0`; None: the
    policy's step-0 weights, saved so that the sampler outlives snapshot eviction."""
    rng, logger = random.Random(cfg.seed), get_logger()
    params = types.SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, stop=env.stop())
    if cfg.kl_coef > 0 and reference is None:
        reference = step0_reference(policy)
    with logger.prefix(prefix):
        sampler = policy.save_weights_and_get_sampling_client().result()
        for step in range(cfg.steps):
            with span("sample"):
                problems = env.sample_problems(cfg.prompts_per_step, rng)
                groups = collect_groups(env, problems, submit_samples(sampler, problems, cfg.samples_per_prompt,
                                                                      params, rng))
                rollouts = [r for g in groups for r in g if r.tokens]
            if not rollouts:
                raise ValueError("PPO: every sampled completion was empty")
            with span("roles"):
                exps = role_forwards(rollouts, critic, reference if cfg.kl_coef > 0 else None, reward_model,
                                     overlap=cfg.overlap)
            with span("gae"):
                compute_advantages(exps, cfg)
            with span("train"):
                update(policy, critic, exps, cfg, rng, overlap=cfg.overlap)
            record_step_metrics(exps)
            with span("sync"):
                sampler = policy.save_weights_and_get_sampling_client().result()
            summary = logger.flush(step)
            if on_step is not None:
                on_step(step, summary)
    return sampler


def full_ft_client(service_client, base_model: str, field_name: str):
    """A full-FT value-head run: ember's `create_full_training_client` (not in the tinker SDK)."""
    if not hasattr(service_client, "create_full_training_client"):
        raise ValueError(f"{field_name}: full fine-tuning needs ember's create_full_training_client, which "
                         f"{type(service_client).__name__} lacks (the tinker SDK); use a LoRA run instead")
    return service_client.create_full_training_client(base_model, user_metadata=dict(VALUE_HEAD)).result()


def value_run_from_state(service_client, path: str):
    """Restore a value-head run; the head named in user_metadata makes the service refuse a policy checkpoint."""
    return service_client.create_training_client_from_state(path, user_metadata=dict(VALUE_HEAD)).result()


def create_critic(service_client, cfg: PPOConfig):
    base = cfg.critic_base_model or cfg.base_model
    if cfg.critic_init_from:
        return value_run_from_state(service_client, cfg.critic_init_from)
    if cfg.critic_full_ft:
        return full_ft_client(service_client, base, "PPOConfig.critic_full_ft")
    return service_client.create_lora_training_client(base_model=base, rank=cfg.critic_lora_rank,
                                                      seed=cfg.seed, user_metadata=dict(VALUE_HEAD)).result()


def critic_service(cfg: PPOConfig, policy_service, stack: contextlib.ExitStack):
    """The service client the critic lives on: `critic_client` when it names one, else the policy's."""
    from ember.recipes.common import make_service_client

    if not (cfg.critic_client.base_url or cfg.critic_client.models):
        return policy_service
    return stack.enter_context(make_service_client(cfg.critic_client))


def run_ppo(config: PPOConfig, on_step: StepHook | None = None) -> str | None:
    """Create policy, critic (and reward model), train, save both; returns the policy's saved path
    and prints the critic's."""
    from ember.recipes.common import make_service_client

    check_env_name(config.env, "PPOConfig")
    with contextlib.ExitStack() as stack:  # clients closed at the end: an open SDK client heartbeats forever
        sc = stack.enter_context(make_service_client(config.client))
        if config.init_from:
            policy = sc.create_training_client_from_state(config.init_from).result()
        else:
            policy = sc.create_lora_training_client(base_model=config.base_model, rank=config.lora_rank,
                                                    seed=config.seed).result()
        critic = create_critic(critic_service(config, sc, stack), config)
        rm = value_run_from_state(sc, config.reward_model) if config.reward_model else None
        env = make_env(config.env, policy.get_tokenizer(), config.env_args)
        train_ppo(policy, critic, env, config, reward_model=rm, on_step=on_step)
        if not config.save_name:
            return None
        # the critic is its own run: its path is printed (PPOConfig.critic_init_from resumes it)
        print(f"ppo: critic saved {critic.save_state(f'{config.save_name}-critic').result().path}")
        return policy.save_state(config.save_name).result().path
