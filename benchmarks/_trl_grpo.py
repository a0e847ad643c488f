"""TRL's GRPOTrainer on grpo_step.py's model and step shape (`grpo_step.py --trl`).

Same tiny Qwen3, the same digit-sum prompts (text), P prompts x G completions per step
(`per_device_train_batch_size` = P*G, `num_generations` = G, one generation per optimizer
step), <= MAX_TOKENS new tokens at temperature 1, LoRA of the same rank on every linear
layer, AdamW at the same LR and betas, no reference model (beta 0), random 0/1 rewards.
Generation is transformers' `generate` (TRL's default without vLLM). A step's time is the
wall clock between TRL's `on_step_end` callbacks. TRL is not a dependency of ember: run with
it on PYTHONPATH (README "Benchmarks").
"""

from __future__ import annotations

import random
import time
from pathlib import Path


def trl_config(out: Path, args, lr: float, max_tokens: int):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
        steps_per_generation=1, max_completion_length=max_tokens, temperature=1.0, learning_rate=lr,
        adam_beta2=0.95, beta=0.0, loss_type="grpo", scale_rewards="none", max_steps=args.warmup + args.steps,
        logging_strategy="no", disable_tqdm=True, report_to="none", use_cpu=True, save_strategy="no",
        shuffle_dataset=False, dataloader_num_workers=0, log_completions=False, lr_scheduler_type="constant",
        warmup_steps=0)


def run_trl(model_dir: Path, out: Path, args, rank: int, lr: float, max_tokens: int) -> list[dict[str, float]]:
    """`args.warmup + args.steps` TRL GRPO steps; returns the timed ones as {"wall": seconds}."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOTrainer

    from ember.models import load_tokenizer
    from ember.recipes.digit_sum import DigitSumTask

    tokenizer = load_tokenizer(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    task, rng = DigitSumTask(tokenizer), random.Random(0)
    prompts = [task.problem(rng.randint(10_000, 99_999)).text for _ in range(args.prompts * (args.warmup + args.steps))]
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_a, **_k):
            stamps.append(time.perf_counter())

    def reward(completions, **_):
        return [float(rng.random() < 0.5) for _ in completions]

    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(str(model_dir)), reward_funcs=reward,
        args=trl_config(out, args, lr, max_tokens), train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer, peft_config=LoraConfig(r=rank, lora_alpha=32, target_modules="all-linear"),
        callbacks=[Clock()])
    stamps.append(time.perf_counter())
    trainer.train()
    walls = [b - a for a, b in zip(stamps, stamps[1:])]
    return [{"wall": w} for w in walls[args.warmup:]]
