"""`ember demo`: teach a model digit sums with SFT, then GRPO from a verifier, on CPU.

From nothing: a small Qwen3 with random weights and a character tokenizer is built in
the run directory; a LoRA adapter learns the format from a fixed small labelled set
(SFT warm-up), then GRPO learns from an exact-match reward on fresh unlabelled prompts.
An SFT-only control continues from the same warm-up checkpoint for the same number of
steps on the same labelled set, so the gain from RL is measured against more SFT, not
against nothing. Everything goes through the public Tinker API of the in-process
`ember.ServiceClient` (the recipes in `ember.recipes.sft` / `grpo`).

`ember demo --model DIR` runs the same recipe on a real HF checkpoint (GPU when present).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

DEMO_MODEL_NAME = "digit-sum-tiny"


@dataclass
class DemoSettings:
    """The demo's knobs (defaults calibrated on a 2-core CPU; see README)."""

    seed: int = 0
    lora_rank: int = 64
    labels: int = 200  # fixed labelled set for SFT (and the control)
    heldout: int = 200  # held-out numbers, greedy exact match
    min_digits: int = 3
    max_digits: int = 5
    sft_steps: int = 150
    sft_batch: int = 128
    sft_lr: float = 2e-3
    grpo_steps: int = 1200
    prompts_per_step: int = 16
    group_size: int = 8
    grpo_lr: float = 2e-4
    grpo_schedule: str = "cosine"
    grpo_beta2: float = 0.95
    max_tokens: int = -1  # -1: the longest answer + EOS for the char tokenizer (" 45" + EOS = 4)
    temperature: float = 1.0
    loss_fn: str = "importance_sampling"
    minibatches: int = 1  # optimizer steps per GRPO batch
    # 1: sample the next batch while this one trains (one step off-policy, corrected by the
    # importance-sampling loss): 497 s instead of 574 s for seed 0, accuracy as on-policy.
    max_staleness: int = 1
    # The SFT-only control continues from the warm-up checkpoint with GRPO's optimization
    # budget: as many optimizer steps, as many prompts per step, the same LR and schedule,
    # but labelled examples from the same fixed set instead of sampled, verified completions.
    control_steps: int = -1  # -1: grpo_steps * minibatches (GRPO's optimizer steps)
    control_batch: int = -1  # -1: prompts_per_step / minibatches
    control_lr: float = -1.0  # -1: grpo_lr (with grpo_schedule)
    eval_every: int = 300
    hidden_size: int = 128
    num_layers: int = 2

    def __post_init__(self) -> None:
        from ember.recipes.common import RL_LOSSES, SCHEDULES

        if self.grpo_schedule not in SCHEDULES:
            raise ValueError(f"--grpo-schedule must be one of {', '.join(SCHEDULES)}, got {self.grpo_schedule!r}")
        if self.loss_fn not in RL_LOSSES:
            raise ValueError(f"--loss-fn must be one of {', '.join(RL_LOSSES)}, got {self.loss_fn!r}")
        if self.max_tokens < 0:
            self.max_tokens = len(str(9 * self.max_digits)) + 2
        if self.control_steps < 0:
            self.control_steps = self.grpo_steps * self.minibatches
        if self.control_batch < 0:
            self.control_batch = max(1, self.prompts_per_step // self.minibatches)
        if self.control_lr < 0:
            self.control_lr = self.grpo_lr


# `--quick`: a couple of minutes, to check that everything runs; too short for RL to pull away.
QUICK = dict(sft_steps=100, grpo_steps=120, eval_every=60, heldout=100)
# `--model DIR` on a real checkpoint: smaller learning rates, fewer steps.
REAL_MODEL = dict(lora_rank=32, sft_steps=60, sft_batch=32, sft_lr=2e-4, grpo_steps=200, grpo_lr=4e-5,
                  max_tokens=8, eval_every=50)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=None, help="seed of the model, data and sampling (default 0)")
    parser.add_argument("--quick", action="store_true",
                        help="a short run (about 2 minutes) to check the setup; too short for the full effect")
    parser.add_argument("--model", default=None, help="a local HF checkpoint instead of the tiny random model")
    parser.add_argument("--run-dir", default=None, help="output directory (default runs/demo-<timestamp>)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op CPU threads (default 1: the trainer and the sampler already run on "
                             "separate threads; 2 is ~10%% faster on an idle 2-core machine, much slower on a busy one)")
    parser.add_argument("--no-progress", action="store_true", help="plain log lines instead of live bars")
    parser.add_argument("--no-control", action="store_true", help="skip the SFT-only control")
    for f in fields(DemoSettings):
        if f.name == "seed":
            continue
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=None,
                            dest=f.name, help=f"(default {f.default})")


def settings_from_args(args: argparse.Namespace) -> DemoSettings:
    values: dict[str, Any] = {}
    if args.model:
        values.update(REAL_MODEL)
    if args.quick:
        values.update(QUICK)
    for f in fields(DemoSettings):
        if getattr(args, f.name, None) is not None:
            values[f.name] = getattr(args, f.name)
    return DemoSettings(**values)


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ValueError as e:
        print(f"ember demo: {e}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S"))
    _configure_threads(args.threads)
    from ember.recipes.demo_run import run_demo

    summary = run_demo(settings, run_dir, model_dir=args.model, live=None if not args.no_progress else False,
                       control=not args.no_control)
    return 0 if summary.get("completed") else 1


def _configure_threads(threads: int | None) -> None:
    import torch

    # One thread by default. Seed 0 on an idle 2-core machine: 425-497 s with 1 thread,
    # 405 s with 2; but with other work on the cores, 2 threads per op on top of the
    # trainer and sampler threads oversubscribe badly (the fast demo test took 352 s
    # with 2 threads vs 29 s with 1 on a loaded machine).
    torch.set_num_threads(threads or 1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TINKER_TELEMETRY", "0")


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")


def settings_dict(settings: DemoSettings) -> dict[str, Any]:
    return asdict(settings)
