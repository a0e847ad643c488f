"""A Bradley-Terry reward model on preference pairs, flat, on the public Tinker API only.

The reward model is a value-head run (`user_metadata={"ember.head": "value"}`); the score
of a sequence is the value at its last position (it has attended to every token). Per
pair: loss = softplus(-(s_chosen - s_rejected)) = -log sigmoid(s_c - s_r), averaged over
the batch's pairs.

There is no built-in pairwise loss: every built-in loss is a per-token sum
(docs/architecture.md contract 1), and the engine may put a pair's two sequences in different micro-batches,
so no per-micro-batch loss sees both. The pairwise term therefore runs on the client
through `forward_backward_custom`: a forward gives every score, the loss and its gradient
are computed here, and the gradient goes back as per-token weights of a `cross_entropy`
step (exact for any per-token output, a value head's included).

Data (`data`): a name from `PREFERENCE_DATA` (`"synthetic_digits"`: digit-sum prompts,
chosen = the digit answer, rejected = letters of the same length -- an easy preference) or
a JSONL path of {"prompt", "chosen", "rejected"} strings (EOS appended to both
completions, as sampled completions end with it). The last `eval_pairs` pairs are held out;
`heldout_accuracy` is the fraction of them ranked right. PPO uses the saved state as its
reward: `PPOConfig.reward_model = <the path this recipe prints>`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tinker import types

from ember.metrics import MetricsConfig, get_logger, record_metric, span
from ember.recipes.common import ClientConfig, StepHook
from ember.recipes.ppo import VALUE_HEAD, full_ft_client, score_datum

Pair = tuple[list[int], list[int], list[int]]  # (prompt, chosen, rejected) tokens


@dataclass
class RMConfig:
    base_model: str = ""
    lora_rank: int = 32
    full_ft: bool = False  # full fine-tuning instead of LoRA
    steps: int = 30
    pairs_per_step: int = 16
    learning_rate: float = 1e-4
    adam_beta2: float = 0.95
    data: str = "synthetic_digits"  # a PREFERENCE_DATA name or a JSONL path
    train_pairs: int = 512  # synthetic data only: how many training pairs to draw
    eval_pairs: int = 64  # held out (the last pairs of a JSONL file)
    eval_every: int = 0  # steps between held-out evaluations (0: only after the last step)
    seed: int = 0
    run_dir: str = ""
    save_name: str = "final"
    client: ClientConfig = field(default_factory=ClientConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        for name in ("lora_rank", "steps", "pairs_per_step", "train_pairs", "eval_pairs"):
            if getattr(self, name) < 1:
                raise ValueError(f"RMConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.learning_rate > 0 or self.eval_every < 0:
            raise ValueError(f"RMConfig: need learning_rate > 0 and eval_every >= 0, got "
                             f"{self.learning_rate}, {self.eval_every}")
        if not self.data:
            raise ValueError("RMConfig.data: expected a name from PREFERENCE_DATA or a JSONL path, got ''")


def synthetic_digits(tokenizer, count: int, seed: int) -> list[Pair]:
    """Digit-sum prompts; chosen = ` <digit sum>` + EOS, rejected = letters of the same length + EOS."""
    from ember.recipes.digit_sum import PROMPT_TEMPLATE, DigitSumTask, digit_sum

    task, rng = DigitSumTask(tokenizer), random.Random(seed + 1)
    letters = sorted({c for c in PROMPT_TEMPLATE.format(n="") if c.isalpha()})  # in the tiny tokenizers' alphabet
    pairs = []
    for n in task.numbers(count, seed):
        bad = "".join(rng.choice(letters) for _ in str(digit_sum(n)))
        pairs.append((task.prompt_tokens(n), task.answer_tokens(n),
                      tokenizer.encode(f" {bad}", add_special_tokens=False) + [task.eos]))
    return pairs


def jsonl_pairs(path: str | Path, tokenizer) -> list[Pair]:
    """{"prompt", "chosen", "rejected"} strings per line; EOS appended to both completions."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"RMConfig.data: no preference data named {str(path)!r} and no such file; "
                                f"known names: {sorted(PREFERENCE_DATA)}")
    eos, out = tokenizer.eos_token_id, []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{i + 1}: not valid JSON ({e})") from None
        if not isinstance(rec, dict) or any(not isinstance(rec.get(k), str) or not rec[k] for k in
                                            ("prompt", "chosen", "rejected")):
            raise ValueError(f"{p}:{i + 1}: expected non-empty strings 'prompt', 'chosen', 'rejected'")
        enc = [tokenizer.encode(rec[k], add_special_tokens=False) for k in ("prompt", "chosen", "rejected")]
        out.append((enc[0], enc[1] + [eos], enc[2] + [eos]))
    return out


PREFERENCE_DATA: dict[str, Any] = {"synthetic_digits": synthetic_digits}  # name -> f(tokenizer, count, seed)


def load_pairs(cfg: RMConfig, tokenizer) -> tuple[list[Pair], list[Pair]]:
    """(training pairs, held-out pairs)."""
    if cfg.data in PREFERENCE_DATA:
        pairs = PREFERENCE_DATA[cfg.data](tokenizer, cfg.train_pairs + cfg.eval_pairs, cfg.seed)
    else:
        pairs = jsonl_pairs(cfg.data, tokenizer)
    if len(pairs) <= cfg.eval_pairs:
        raise ValueError(f"RMConfig.eval_pairs: {cfg.data} has {len(pairs)} pairs; need more than "
                         f"eval_pairs ({cfg.eval_pairs}) to train on")
    return pairs[:-cfg.eval_pairs], pairs[-cfg.eval_pairs:]


def pair_datums(pairs: Sequence[Pair]) -> list[types.Datum]:
    """chosen, rejected, chosen, rejected, ...: pair j is datums (2j, 2j+1)."""
    return [score_datum([*p, *c]) for p, chosen, rejected in pairs for c in (chosen, rejected)]


def bt_loss(data: list[types.Datum], values_list: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """Bradley-Terry, mean over pairs; the score is the value at the last position."""
    scores = torch.stack([v[-1] for v in values_list])
    margin = scores[0::2] - scores[1::2]
    loss = torch.nn.functional.softplus(-margin).mean()
    margin = margin.detach()
    return loss, {"accuracy": float((margin > 0).float().mean()), "margin": float(margin.mean())}


def heldout_accuracy(rm, pairs: Sequence[Pair]) -> float:
    """Fraction of pairs whose chosen completion scores above the rejected one (forward only)."""
    outs = rm.forward(pair_datums(pairs), "cross_entropy").result().loss_fn_outputs
    scores = [out["logprobs"].data[-1] for out in outs]
    return sum(c > r for c, r in zip(scores[0::2], scores[1::2])) / len(pairs)


def train_reward_model(rm, train: Sequence[Pair], heldout: Sequence[Pair], cfg: RMConfig,
                       on_step: StepHook | None = None, prefix: str = "rm/") -> float:
    """`cfg.steps` Bradley-Terry steps; returns the final held-out accuracy."""
    rng, logger, order = random.Random(cfg.seed), get_logger(), []
    adam = types.AdamParams(learning_rate=cfg.learning_rate, beta2=cfg.adam_beta2)
    acc = float("nan")
    with logger.prefix(prefix):
        for step in range(cfg.steps):
            while len(order) < cfg.pairs_per_step:  # epochs over the shuffled training pairs
                epoch = list(range(len(train)))
                rng.shuffle(epoch)
                order += epoch
            batch, order = [train[i] for i in order[:cfg.pairs_per_step]], order[cfg.pairs_per_step:]
            with span("train"):
                fb = rm.forward_backward_custom(pair_datums(batch), bt_loss)
                opt = rm.optim_step(adam)
                metrics = fb.result().metrics
                opt.result()
            record_metric("loss", metrics["loss:sum"])
            record_metric("accuracy", metrics["accuracy"])
            record_metric("margin", metrics["margin"])
            last = step + 1 == cfg.steps
            if last or (cfg.eval_every > 0 and (step + 1) % cfg.eval_every == 0):
                with span("eval"):
                    acc = heldout_accuracy(rm, heldout)
                record_metric("heldout_accuracy", acc)
            summary = logger.flush(step)
            if on_step is not None:
                on_step(step, summary)
    return acc


def run_reward_model(config: RMConfig, on_step: StepHook | None = None) -> str | None:
    """Create a value-head run, train it, save it; returns the saved path (PPO's `reward_model`)."""
    from ember.recipes.common import make_service_client

    with make_service_client(config.client) as sc:  # closed at the end: an open SDK client heartbeats forever
        if config.full_ft:
            rm = full_ft_client(sc, config.base_model, "RMConfig.full_ft")
        else:
            rm = sc.create_lora_training_client(base_model=config.base_model, rank=config.lora_rank,
                                                seed=config.seed, user_metadata=dict(VALUE_HEAD)).result()
        train, heldout = load_pairs(config, rm.get_tokenizer())
        train_reward_model(rm, train, heldout, config, on_step=on_step)
        if not config.save_name:
            return None
        return rm.save_state(config.save_name).result().path
