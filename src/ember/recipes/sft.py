"""Supervised fine-tuning, flat, on the public Tinker API only.

Runs unchanged on `ember.ServiceClient()` and on `tinker.ServiceClient(base_url=...)`
against `ember serve`: it uses `create_lora_training_client`, `forward_backward`
(`cross_entropy`), `optim_step` and `save_state`.

Data (`data_path`): a name from `SFT_DATA` (`"digit_sums"`: 64 labelled digit-sum
examples, made in code, so the packaged example config runs in any directory) or a JSONL
file, one example per line, any of
  {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}
      (chat template; the last message is the completion, everything before it the prompt)
  {"prompt": "...", "completion": "..."}   (EOS appended to the completion)
  {"text": "..."}                          (every token but the first is trained)

Normalisation: Tinker's cross_entropy is a SUM of -w*logp. Each completion token of a
batch gets weight 1/(completion tokens in the batch), so `loss:sum` is the token-mean
NLL and the gradient scale does not depend on batch size or lengths. Prompt tokens get 0.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinker import types

from ember.metrics import MetricsConfig, get_logger, record_metric, span
from ember.recipes.common import SCHEDULES, ClientConfig, Evaluator, Schedule, StepHook, learning_rate_at, sft_datum

Example = tuple[list[int], list[int]]  # (prompt tokens, completion tokens)


@dataclass
class SFTConfig:
    base_model: str = ""
    data_path: str = ""
    lora_rank: int = 32
    steps: int = 100
    batch_size: int = 32
    learning_rate: float = 1e-4
    lr_schedule: Schedule = "constant"
    max_length: int = 2048
    seed: int = 0
    eval_every: int = 0  # steps between evaluations when train_sft gets an `evaluate` (0: none)
    run_dir: str = ""  # empty: runs/sft-<timestamp>
    save_name: str = "final"  # save_state name at the end; empty: do not save
    client: ClientConfig = field(default_factory=ClientConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        for name in ("lora_rank", "steps", "batch_size", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"SFTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_every < 0:
            raise ValueError(f"SFTConfig.eval_every must be >= 0, got {self.eval_every}")
        if not self.learning_rate > 0:
            raise ValueError(f"SFTConfig.learning_rate must be > 0, got {self.learning_rate}")
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(f"SFTConfig.lr_schedule must be one of {SCHEDULES}, got {self.lr_schedule!r}")


def example_from_record(record: dict, tokenizer, max_length: int, where: str) -> Example:
    """Tokenize one JSONL record into (prompt, completion) tokens, truncated to max_length."""
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or len(messages) < 2:
            raise ValueError(f"{where}: 'messages' must be a list of at least 2 messages")
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages, tokenize=True)
        prompt, full = _ids(prompt), _ids(full)
        if full[: len(prompt)] != prompt:
            raise ValueError(f"{where}: the chat template does not render the prompt as a prefix of the conversation")
        completion = full[len(prompt) :]
    elif "prompt" in record and "completion" in record:
        prompt = tokenizer.encode(record["prompt"], add_special_tokens=False)
        completion = tokenizer.encode(record["completion"], add_special_tokens=False) + [tokenizer.eos_token_id]
    elif "text" in record:
        ids = tokenizer.encode(record["text"], add_special_tokens=False)
        prompt, completion = ids[:1], ids[1:]
    else:
        raise ValueError(f"{where}: expected a 'messages', 'prompt'+'completion' or 'text' field, got {sorted(record)}")
    completion = completion[: max(0, max_length - len(prompt))]
    if not prompt or not completion:
        raise ValueError(f"{where}: nothing to train on (prompt {len(prompt)} tokens, completion {len(completion)})")
    return list(prompt), list(completion)


def _ids(rendered) -> list[int]:
    # transformers 5 may return a BatchEncoding/dict from apply_chat_template(tokenize=True).
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def load_jsonl(path: str | Path, tokenizer, max_length: int = 2048) -> list[Example]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"SFT data file not found: {str(p)!r} (data_path is a JSONL path or one of "
                                f"{sorted(SFT_DATA)})")
    out = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines()):
        if line.strip():
            where = f"{p}:{i + 1}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
            out.append(example_from_record(record, tokenizer, max_length, where))
    if not out:
        raise ValueError(f"{p}: no examples")
    return out


def digit_sums(tokenizer, seed: int) -> list[Example]:
    """64 labelled digit-sum examples (`Sum the digits of 40913:` -> ` 17` + EOS)."""
    from ember.recipes.digit_sum import DigitSumTask

    task = DigitSumTask(tokenizer)
    return task.labelled_examples(task.numbers(64, seed=seed))


SFT_DATA: dict[str, Any] = {"digit_sums": digit_sums}  # name -> f(tokenizer, seed)


def load_sft_data(data_path: str, tokenizer, max_length: int, seed: int) -> list[Example]:
    """`SFTConfig.data_path`: a `SFT_DATA` name (when no such file exists) or a JSONL path."""
    if data_path in SFT_DATA and not Path(data_path).exists():
        return SFT_DATA[data_path](tokenizer, seed)  # short by construction (under 40 tokens)
    return load_jsonl(data_path, tokenizer, max_length)


def batch_datums(examples: Sequence[Example]) -> list[types.Datum]:
    """Datums whose weights make the summed loss a token mean over the batch's completions."""
    n_tokens = sum(len(c) for _, c in examples)
    return [sft_datum(p, c, weight=1.0 / n_tokens) for p, c in examples]


def sft_step(training_client, examples: Sequence[Example], lr: float) -> float:
    """One optimizer step on `examples`; returns the token-mean NLL before the update."""
    # Submit both before waiting: the service pipelines them (over HTTP too).
    fb = training_client.forward_backward(batch_datums(examples), "cross_entropy")
    opt = training_client.optim_step(types.AdamParams(learning_rate=lr))
    loss = fb.result().metrics["loss:sum"]
    opt.result()
    return loss


def train_sft(
    training_client, examples: Sequence[Example], cfg: SFTConfig, on_step: StepHook | None = None,
    evaluate: Evaluator | None = None, prefix: str = "sft/",
) -> None:
    """`cfg.steps` optimizer steps on batches of `cfg.batch_size` drawn with replacement from `examples`.

    Metrics are recorded as `<prefix><name>` and flushed once per step. With `evaluate`,
    every `cfg.eval_every` steps (and after the last) a sampler snapshot is evaluated.
    """
    rng = random.Random(cfg.seed)
    logger = get_logger()
    with logger.prefix(prefix):
        for step in range(cfg.steps):
            lr = learning_rate_at(step, cfg.steps, cfg.learning_rate, cfg.lr_schedule)
            batch = [examples[rng.randrange(len(examples))] for _ in range(cfg.batch_size)]
            with span("step"):
                loss = sft_step(training_client, batch, lr)
            record_metric("loss", loss)
            record_metric("lr", lr)
            record_metric("tokens", sum(len(c) for _, c in batch), reduce="sum")
            last = step + 1 == cfg.steps
            if evaluate is not None and cfg.eval_every > 0 and ((step + 1) % cfg.eval_every == 0 or last):
                sampler = training_client.save_weights_and_get_sampling_client().result()
                for key, value in evaluate(sampler, step + 1).items():
                    record_metric(key, value)
            summary = logger.flush(step)
            if on_step is not None:
                on_step(step, summary)


def run_sft(config: SFTConfig, on_step: StepHook | None = None) -> str | None:
    """Load data, train a LoRA adapter, save it; returns the saved `tinker://` path (or None)."""
    from ember.recipes.common import make_service_client

    service_client = make_service_client(config.client)
    training_client = service_client.create_lora_training_client(
        base_model=config.base_model, rank=config.lora_rank, seed=config.seed
    ).result()
    tokenizer = training_client.get_tokenizer()
    examples = load_sft_data(config.data_path, tokenizer, config.max_length, config.seed)
    train_sft(training_client, examples, config, on_step=on_step)
    if not config.save_name:
        return None
    return training_client.save_state(config.save_name).result().path
