"""One GRPO step of the demo's shape, timed by phase: ember vs a hand-written PyTorch step.

Step = sample P prompts x G completions, forward_backward (importance_sampling) +
optim_step on every completion, weight sync (a new sampler snapshot). ember runs it
through the public API of the in-process `ember.ServiceClient` (the GRPO recipe's own
functions); the baseline does the same work in plain PyTorch on one model (HF
`generate` with KV cache, one padded forward/backward, AdamW, a clone of the adapter
weights as the "sync"). Rewards are random so that every group trains (a random model
never gets a digit sum right), and prompts have one length so `generate` needs no padding.
Both sides run the phases one after the other (the demo's default `max_staleness=1`
overlaps the next batch's sampling with this batch's training; this measures the parts).

    python benchmarks/grpo_step.py [--prompts 16] [--group 8] [--steps 10] [--threads 1]

Last line: step_s=<ember s/step> sample_frac=<a> train_frac=<b> sync_frac=<c> plain_torch_ratio=<baseline s / ember s>
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import torch  # noqa: E402
from tinker import types  # noqa: E402

from ember.recipes.rl.env import Environment, Problem  # noqa: E402

RANK, LR, MAX_TOKENS = 64, 2e-4, 4  # the demo's: ' 45' + EOS


class RandomRewardEnv(Environment):
    """Five-digit digit-sum prompts; reward drawn at random (every group has signal)."""

    def __init__(self, task, seed: int) -> None:
        self.task, self.rng = task, random.Random(seed)

    def sample_problems(self, n, rng):
        return [self.task.problem(rng.randint(10_000, 99_999)) for _ in range(n)]

    def reward(self, problem: Problem, completion_tokens) -> float:
        return float(self.rng.random() < 0.5)

    def stop(self):
        return [self.task.eos]


def build_model(out: Path) -> Path:
    from ember.models.testing import build_tiny_model
    from ember.recipes.digit_sum import ALPHABET

    return build_tiny_model(out, family="qwen3", seed=0, tokenizer_alphabet=ALPHABET, hidden_size=128,
                            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32)


def ember_step(tc, sampler, env, rng, args, cfg) -> tuple[dict[str, float], object]:
    from ember.recipes.grpo import train_on_batch
    from ember.recipes.rl.rollouts import collect_groups, submit_samples

    params = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, stop=env.stop())
    t0 = time.perf_counter()
    problems = env.sample_problems(args.prompts, rng)
    groups = collect_groups(env, problems, submit_samples(sampler, problems, args.group, params, rng))
    t1 = time.perf_counter()
    train_on_batch(tc, groups, cfg, LR)
    t2 = time.perf_counter()
    sampler = tc.save_weights_and_get_sampling_client().result()
    t3 = time.perf_counter()
    return {"sample": t1 - t0, "train": t2 - t1, "sync": t3 - t2}, sampler


def run_ember(model_dir: Path, data_dir: Path, args) -> list[dict[str, float]]:
    import ember
    from ember.recipes.digit_sum import DigitSumTask
    from ember.recipes.grpo import GRPOConfig

    sc = ember.ServiceClient(models={"bench": str(model_dir)}, data_dir=str(data_dir))
    try:
        tc = sc.create_lora_training_client(base_model="bench", rank=RANK, seed=0).result()
        env = RandomRewardEnv(DigitSumTask(tc.get_tokenizer()), seed=1)
        cfg = GRPOConfig(prompts_per_step=args.prompts, group_size=args.group, max_tokens=MAX_TOKENS)
        sampler, rng, times = tc.save_weights_and_get_sampling_client().result(), random.Random(0), []
        for i in range(args.warmup + args.steps):
            t, sampler = ember_step(tc, sampler, env, rng, args, cfg)
            if i >= args.warmup:
                times.append(t)
        return times
    finally:
        sc.close("success")


def baseline_step(model, opt, task, rng, args) -> dict[str, float]:
    eos = task.eos
    t0 = time.perf_counter()
    prompts = [task.prompt_tokens(rng.randint(10_000, 99_999)) for _ in range(args.prompts)]
    ids = torch.tensor([p for p in prompts for _ in range(args.group)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                             max_new_tokens=MAX_TOKENS, eos_token_id=eos, pad_token_id=eos,
                             output_logits=True, return_dict_in_generate=True)
    new = out.sequences[:, ids.shape[1]:]
    old_logp = torch.stack([torch.log_softmax(x.float(), -1) for x in out.logits], 1).gather(2, new[..., None])[..., 0]
    done = torch.cumsum((new == eos).int(), 1) - (new == eos).int()  # positions after the first EOS
    mask = (done == 0).float()
    rewards = torch.tensor([float(rng.random() < 0.5) for _ in range(len(new))]).view(args.prompts, args.group)
    adv = ((rewards - rewards.mean(1, keepdim=True)).view(-1, 1) / len(new)) * mask
    t1 = time.perf_counter()
    logits = model(out.sequences[:, :-1]).logits[:, ids.shape[1] - 1:]
    logp = torch.log_softmax(logits.float(), -1).gather(2, new[..., None])[..., 0]
    loss = -(torch.exp(logp - old_logp) * adv).sum()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t2 = time.perf_counter()
    _snapshot = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    t3 = time.perf_counter()
    return {"sample": t1 - t0, "train": t2 - t1, "sync": t3 - t2}


def run_baseline(model_dir: Path, args) -> list[dict[str, float]]:
    from ember.models import apply_lora, load_model, load_tokenizer
    from ember.recipes.digit_sum import DigitSumTask

    model = apply_lora(load_model(model_dir), types.LoraConfig(rank=RANK, seed=0))
    task = DigitSumTask(load_tokenizer(model_dir))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, betas=(0.9, 0.95), eps=1e-12)
    rng, times = random.Random(0), []
    for i in range(args.warmup + args.steps):
        t = baseline_step(model, opt, task, rng, args)
        if i >= args.warmup:
            times.append(t)
    return times


def summarize(name: str, times: list[dict[str, float]]) -> dict[str, float]:
    mean = {k: statistics.mean(t[k] for t in times) for k in ("sample", "train", "sync")}
    step = sum(mean.values())
    print(f"{name:<12} step {step * 1000:8.1f} ms | " + " | ".join(
        f"{k} {v * 1000:7.1f} ms ({v / step:5.1%})" for k, v in mean.items()))
    return {"step": step, **mean}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the demo's default is 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model")
        print(f"GRPO step: {args.prompts} prompts x {args.group} samples, <= {MAX_TOKENS} new tokens, "
              f"LoRA rank {RANK}, {args.threads} threads, mean of {args.steps} steps after {args.warmup} warm-up")
        ours = summarize("ember", run_ember(model_dir, Path(tmp) / "data", args))
        base = summarize("plain torch", run_baseline(model_dir, args))
    ratio = base["step"] / ours["step"]
    print(f"plain-torch step / ember step = {ratio:.2f} (> 1: ember is faster)")
    print(f"step_s={ours['step']:.4f} sample_frac={ours['sample'] / ours['step']:.3f} "
          f"train_frac={ours['train'] / ours['step']:.3f} sync_frac={ours['sync'] / ours['step']:.3f} "
          f"plain_torch_ratio={ratio:.2f}")


if __name__ == "__main__":
    main()
