"""One GRPO step of the demo's shape: ember eager/compiled x sync/async, plain PyTorch, optionally TRL.

Step = sample P prompts x G completions, forward_backward (importance_sampling) +
optim_step on every completion, weight sync. ember runs its GRPO recipe (`train_grpo`)
through the in-process `ember.ServiceClient` in four modes, in one run: eager sync
(`max_steps_off_policy=0`: sample, train, snapshot, one after the other), eager async
(`max_steps_off_policy=1`: a rollout thread samples the next step's groups from an in-flight
client while this step trains), and both again with `EngineConfig.compile` (regional
torch.compile; its warm-up, paid when the training client is created and in the first steps,
is reported and in no step time). A step's time is the wall clock between the recipe's step
ends. The baseline does the sync step's work in plain PyTorch on one model (HF `generate`
with KV cache, one padded forward/backward, AdamW, a clone of the adapter weights as the
"sync"). `--trl` adds TRL's GRPOTrainer on the same model and step shape (benchmarks/_trl_grpo.py;
TRL on PYTHONPATH). Rewards are random so that every group trains (a random model never gets
a digit sum right), and prompts have one length so `generate` needs no padding.

    python benchmarks/grpo_step.py [--prompts 16] [--group 8] [--steps 8] [--threads 1] [--trl]

Last line: step_s=<ember eager sync s/step> sample_frac=<a> train_frac=<b> sync_frac=<c>
plain_torch_ratio=<baseline s / ember s> compile_warmup_s=<s> compile_vs_eager=<eager sync s /
compiled sync s> async_vs_sync=<eager sync s / eager async s> [ember_vs_trl=<TRL s / ember's
fastest mode s> ember_best=<that mode>] (ratios > 1: the second is faster)
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


class StepClock:
    """`on_step` hook of `train_grpo`: wall-clock seconds per step (from the previous step's end)
    and the step's `time/<phase>` spans."""

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.steps: list[dict[str, float]] = []

    def __call__(self, step: int, summary: dict) -> None:
        now = time.perf_counter()
        phases = {k: float(summary.get(f"bench/time/{k}", 0.0)) for k in ("sample", "train", "sync")}
        self.steps.append({"wall": now - self.last, **phases})
        self.last = now


def ember_service(model_dir: Path, data_dir: Path, compile_cache: str | None):
    """The in-process service: eager, or `EngineConfig.compile` (regional torch.compile)."""
    import ember
    from ember.engine.config import EngineConfig
    from ember.service.config import ServiceConfig

    engine = EngineConfig(compile=compile_cache is not None, compile_cache_dir=compile_cache or "")
    return ember.ServiceClient(config=ServiceConfig(data_dir=str(data_dir), models={"bench": str(model_dir)},
                                                    engine=engine))


def run_ember(tc, args, max_steps_off_policy: int) -> list[dict[str, float]]:
    """`args.warmup + args.steps` steps of ember's GRPO recipe (sync, or async with a rollout thread)
    on training client `tc`; returns the steps after the warm-up."""
    from ember.metrics import MetricsLogger, use_logger
    from ember.recipes.digit_sum import DigitSumTask
    from ember.recipes.grpo import GRPOConfig, train_grpo

    env = RandomRewardEnv(DigitSumTask(tc.get_tokenizer()), seed=1)
    cfg = GRPOConfig(steps=args.warmup + args.steps, prompts_per_step=args.prompts, group_size=args.group,
                     max_tokens=MAX_TOKENS, learning_rate=LR, max_steps_off_policy=max_steps_off_policy,
                     save_name="")
    clock = StepClock()
    with use_logger(MetricsLogger()):
        train_grpo(tc, env, cfg, on_step=clock, prefix="bench/")
    return clock.steps[args.warmup:]


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
    """Mean seconds per step (`step`: wall clock between step ends) and per phase."""
    mean = {k: statistics.mean(t[k] for t in times) for k in times[0]}
    step = mean.pop("wall") if "wall" in mean else sum(mean.values())
    print(f"{name:<16} step {step * 1000:8.1f} ms | " + " | ".join(
        f"{k} {v * 1000:7.1f} ms ({v / step:5.1%})" for k, v in mean.items()), flush=True)
    return {"step": step, **mean}


def run_ember_modes(model_dir: Path, tmp: Path, args) -> tuple[dict[str, dict[str, float]], float]:
    """Eager sync, eager async (N=1), compiled sync and compiled async: one service and one LoRA
    training client per engine kind, sync then async on it. Returns each mode's summary and the
    compile warm-up's seconds: creating the compiled training client (the engine's warm-up forward
    and backward) minus creating the eager one, plus the compiled sync run's warm-up steps minus
    the eager one's (what compilation costs before the first timed step; in no step time)."""
    out: dict[str, dict[str, float]] = {}
    setup: dict[bool, float] = {}
    for compiled in (False,) if args.no_compile else (False, True):
        cache = (args.compile_cache_dir or str(tmp / "compile-cache")) if compiled else None
        sc = ember_service(model_dir, tmp / f"data-{int(compiled)}", cache)
        try:
            t0 = time.perf_counter()
            tc = sc.create_lora_training_client(base_model="bench", rank=RANK, seed=0).result()
            setup[compiled] = time.perf_counter() - t0
            for n in (0, 1):
                name = f"{'compiled' if compiled else 'eager'} {'async' if n else 'sync'}"
                t0 = time.perf_counter()
                steps = run_ember(tc, args, n)
                if n == 0:  # the warm-up steps (and the final snapshot): what the timed steps leave out
                    setup[compiled] += time.perf_counter() - t0 - sum(t["wall"] for t in steps)
                out[name] = summarize(name, steps)
        finally:
            sc.close("success")
    return out, setup[True] - setup[False] if True in setup else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the demo's default is 1)")
    ap.add_argument("--compile-cache-dir", default="", help="inductor's cache (default: a temporary directory, "
                    "so every run compiles from scratch; name one to measure a warm cache)")
    ap.add_argument("--no-compile", action="store_true", help="leave out the compiled modes (compile_vs_eager=nan): "
                    "a cold compile takes minutes on a loaded CPU")
    ap.add_argument("--trl", action="store_true", help="also TRL's GRPOTrainer on the same model and config "
                    "(needs `trl` importable)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model")
        print(f"GRPO step: {args.prompts} prompts x {args.group} samples, <= {MAX_TOKENS} new tokens, "
              f"LoRA rank {RANK}, {args.threads} threads, mean of {args.steps} steps after {args.warmup} warm-up",
              flush=True)
        modes, warmup_s = run_ember_modes(model_dir, Path(tmp), args)
        print(f"compile warm-up (not in any step time): {warmup_s:.1f} s", flush=True)
        base = summarize("plain torch", run_baseline(model_dir, args))
        trl = run_trl_if_asked(model_dir, Path(tmp), args)
    print_figures(modes, base, trl, warmup_s)


def run_trl_if_asked(model_dir: Path, tmp: Path, args) -> dict[str, float] | None:
    if not args.trl:
        return None
    try:
        from _trl_grpo import run_trl
    except ImportError as e:
        print(f"--trl: TRL is not importable ({e}); left out", file=sys.stderr)
        return None
    return summarize("trl", run_trl(model_dir, tmp / "trl", args, RANK, LR, MAX_TOKENS))


def print_figures(modes: dict[str, dict[str, float]], base: dict[str, float], trl: dict[str, float] | None,
                  warmup_s: float) -> None:
    ours = modes["eager sync"]
    ratio = base["step"] / ours["step"]
    compile_vs_eager = ours["step"] / modes["compiled sync"]["step"] if "compiled sync" in modes else float("nan")
    async_vs_sync = ours["step"] / modes["eager async"]["step"]
    print(f"plain-torch step / ember eager sync step = {ratio:.2f} (> 1: ember is faster)")
    line = (f"step_s={ours['step']:.4f} sample_frac={ours['sample'] / ours['step']:.3f} "
            f"train_frac={ours['train'] / ours['step']:.3f} sync_frac={ours['sync'] / ours['step']:.3f} "
            f"plain_torch_ratio={ratio:.2f} compile_warmup_s={warmup_s:.1f} "
            f"compile_vs_eager={compile_vs_eager:.2f} async_vs_sync={async_vs_sync:.2f}")
    if trl is not None:
        best = min(modes, key=lambda k: modes[k]["step"])
        print(f"TRL step / ember {best} step (ember's fastest mode here) = {trl['step'] / modes[best]['step']:.2f}; "
              + "; ".join(f"TRL / ember {k} = {trl['step'] / v['step']:.2f}" for k, v in modes.items()))
        line += f" ember_vs_trl={trl['step'] / modes[best]['step']:.2f} ember_best={best.replace(' ', '_')}"
    print(line)


if __name__ == "__main__":
    main()
