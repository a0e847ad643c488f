"""One PPO step by phase, with the role forwards and updates overlapped vs serialized.

Step = the PPO recipe's own functions through the in-process `ember.ServiceClient`:
sample P prompts x G completions from the policy's snapshot, role forwards (critic values
+ reference logprobs from the step-0 snapshot [+ reward-model scores]), GAE, one epoch of
policy `ppo` + critic `ppo_value` updates in 2 mini-batches, weight sync (a new snapshot).

Overlapped = every role request submitted before any is awaited, and each mini-batch's
policy and critic requests submitted together (`overlap=True`, the recipe's default);
serialized = each request awaited as soon as it is submitted (`overlap=False`). Both modes
run in the same process on the same runs, alternating (and swapping order) every repeat
so machine noise hits both alike; the runs keep training across repeats, which changes
no shapes. The critic is a full-FT value-head run by default: its own lane, so its
forward and update can run beside the policy's; with `--critic lora` it shares the
policy's lane (one PeftModel) and only the samplers (reference, rollouts) overlap with
training. `--threads` sets torch's threads per op (default: half the cores, so that two
concurrent ops both get cores).

    python benchmarks/ppo_step.py [--prompts 8] [--group 4] [--max-tokens 16] [--repeats 5]
                                  [--critic full|lora] [--reward-model] [--threads N]

Last line: step_s=<overlapped median s/step> overlap_speedup=<serialized median / overlapped median>
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402,F401  (sets HF_HUB_OFFLINE, TINKER_TELEMETRY)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from tinker import types  # noqa: E402

PHASES = ("sample", "roles", "gae", "train", "sync")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--critic", choices=("full", "lora"), default="full")
    p.add_argument("--reward-model", action="store_true", help="add a reward-model forward to the role phase")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    args = p.parse_args()
    for name in ("prompts", "group", "max_tokens", "repeats", "hidden", "layers", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def ppo_step(roles: dict, env, cfg, rng: random.Random, overlap: bool) -> dict[str, float]:
    from ember.recipes.rl.rollouts import collect_groups, submit_samples
    from ember.recipes.ppo import compute_advantages, role_forwards, update

    policy, critic = roles["policy"], roles["critic"]
    params = types.SamplingParams(max_tokens=cfg.max_tokens, temperature=1.0, stop=env.stop())
    t = [time.perf_counter()]
    problems = env.sample_problems(cfg.prompts_per_step, rng)
    groups = collect_groups(env, problems, submit_samples(roles["sampler"], problems, cfg.samples_per_prompt,
                                                          params, rng))
    rollouts = [r for g in groups for r in g if r.tokens]
    t.append(time.perf_counter())
    exps = role_forwards(rollouts, critic, roles["reference"], roles.get("reward_model"), overlap=overlap)
    t.append(time.perf_counter())
    compute_advantages(exps, cfg)
    t.append(time.perf_counter())
    update(policy, critic, exps, cfg, rng, overlap=overlap)
    t.append(time.perf_counter())
    roles["sampler"] = policy.save_weights_and_get_sampling_client().result()
    t.append(time.perf_counter())
    return dict(zip(PHASES, (b - a for a, b in zip(t, t[1:]))))


def create_roles(sc, args) -> dict:
    from ember.recipes.ppo import VALUE_HEAD

    policy = sc.create_lora_training_client(base_model="bench", rank=16, seed=0).result()
    if args.critic == "full":
        critic = sc.create_full_training_client("bench", user_metadata=dict(VALUE_HEAD)).result()
    else:
        critic = sc.create_lora_training_client(base_model="bench", rank=16, seed=1,
                                                user_metadata=dict(VALUE_HEAD)).result()
    from ember.recipes.rl.reference import step0_reference

    roles = {"policy": policy, "critic": critic, "reference": step0_reference(policy),
             "sampler": policy.save_weights_and_get_sampling_client().result()}
    if args.reward_model:
        roles["reward_model"] = sc.create_full_training_client("bench", user_metadata=dict(VALUE_HEAD)).result()
    return roles


def report(times: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    print(f"{'mode':<12}" + "".join(f"{p:>9}" for p in PHASES) + f"{'step':>9}   (median seconds)")
    medians = {}
    for mode, rows in times.items():
        medians[mode] = statistics.median(sum(r.values()) for r in rows)
        print(f"{mode:<12}" + "".join(f"{statistics.median(r[p] for r in rows):>9.3f}" for p in PHASES)
              + f"{medians[mode]:>9.3f}")
    return medians


def main() -> None:
    import ember
    from ember.metrics import MetricsLogger, use_logger
    from ember.recipes.digit_sum import make_env
    from ember.recipes.ppo import PPOConfig

    args = parse_args()
    torch.set_num_threads(args.threads)
    model_dir = _common.build_model(hidden=args.hidden, layers=args.layers)
    cfg = PPOConfig(base_model="bench", prompts_per_step=args.prompts, samples_per_prompt=args.group,
                    max_tokens=args.max_tokens, epochs=1, minibatches=2, kl_coef=0.05, learning_rate=1e-4,
                    critic_learning_rate=1e-4)
    sc = ember.ServiceClient(models={"bench": model_dir}, data_dir=tempfile.mkdtemp(prefix="ember-bench-"))
    print(f"critic={args.critic} ({'own lane' if args.critic == 'full' else 'shares the policy lane'}) "
          f"P={args.prompts} G={args.group} max_tokens={args.max_tokens} threads={args.threads} "
          f"reward_model={args.reward_model}")
    try:
        roles = create_roles(sc, args)
        env, rng = make_env(roles["policy"].get_tokenizer(), partial_credit=True), random.Random(0)
        times: dict[str, list[dict[str, float]]] = {"overlapped": [], "serialized": []}
        with use_logger(MetricsLogger()):  # the recipe's metrics are recorded and dropped
            for i in range(args.warmup + args.repeats):
                order = (True, False) if i % 2 == 0 else (False, True)
                for overlap in order:
                    t = ppo_step(roles, env, cfg, rng, overlap)
                    if i >= args.warmup:
                        times["overlapped" if overlap else "serialized"].append(t)
    finally:
        sc.close("success")
    medians = report(times)
    print(f"step_s={medians['overlapped']:.3f} overlap_speedup={medians['serialized'] / medians['overlapped']:.3f}")


if __name__ == "__main__":
    main()
