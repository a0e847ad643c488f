"""`ember train vlm_sft`: supervised fine-tuning on images, a task made in code.

Each example is a small picture of one coloured shape (a square, a disc or a triangle of a
random size and place, on a dark background) and the question `colour:`; the answer is the
colour's name. The images are PNG bytes sent as Tinker `ImageChunk`s in Tinker's layout
(`<|vision_start|>`, the image, `<|vision_end|>`, as tinker-cookbook's Qwen3-VL renderer
writes it), so the recipe runs unchanged in process and against `ember serve` with the
official SDK. Only public API calls: `forward_backward` (`cross_entropy`), `optim_step`,
`forward` (for accuracy) and `save_state`.

Accuracy: for each held-out picture, the answer is the colour whose name has the highest
summed log-probability after the prompt (one `forward` over every (picture, colour) pair),
so chance is 1 / len(COLOURS). The base model must be a vision-language model
(`ember tiny-model --family qwen3_vl DIR`) named by its directory (the image processor is
read from it to compute `expected_tokens`, as tinker-cookbook's `image_to_chunk` does).
"""

from __future__ import annotations

import io
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from tinker import types

from ember.metrics import MetricsConfig, get_logger, record_metric, span
from ember.recipes.common import ClientConfig, StepHook

COLOURS = {"red": (230, 40, 40), "green": (40, 200, 60), "blue": (50, 70, 230), "yellow": (235, 220, 40)}
SHAPES = ("square", "disc", "triangle")


@dataclass
class VLMSFTConfig:
    base_model: str = ""
    lora_rank: int = 16
    steps: int = 60
    batch_size: int = 16
    learning_rate: float = 5e-3
    image_size: int = 56
    eval_examples: int = 24
    eval_every: int = 20
    seed: int = 0
    run_dir: str = ""  # empty: runs/vlm_sft-<timestamp>
    save_name: str = "final"  # save_state name at the end; empty: do not save
    client: ClientConfig = field(default_factory=ClientConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        for name in ("lora_rank", "steps", "batch_size", "eval_examples", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"VLMSFTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 16 <= self.image_size <= 448:
            raise ValueError(f"VLMSFTConfig.image_size must be in [16, 448], got {self.image_size}")
        if not self.learning_rate > 0:
            raise ValueError(f"VLMSFTConfig.learning_rate must be > 0, got {self.learning_rate}")


@dataclass(frozen=True)
class Example:
    png: bytes
    colour: str


def draw(colour: str, shape: str, size: int, rng: random.Random) -> bytes:
    """A PNG of one `shape` in `colour` at a random size and place, on a dark background."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (20, 20, 24))
    side = rng.randint(size // 2, size - 4)
    x, y = rng.randint(0, size - side), rng.randint(0, size - side)
    pen = ImageDraw.Draw(img)
    box = [x, y, x + side - 1, y + side - 1]
    if shape == "square":
        pen.rectangle(box, fill=COLOURS[colour])
    elif shape == "disc":
        pen.ellipse(box, fill=COLOURS[colour])
    else:
        pen.polygon([(x, y + side - 1), (x + side - 1, y + side - 1), (x + side // 2, y)], fill=COLOURS[colour])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def make_examples(n: int, size: int, seed: int) -> list[Example]:
    rng = random.Random(seed)
    names = list(COLOURS)
    return [Example(draw(c, rng.choice(SHAPES), size, rng), c) for c in (rng.choice(names) for _ in range(n))]


class Layout:
    """Tokens around the image and the answers, from the model's tokenizer and processor."""

    def __init__(self, tokenizer, image_size: int) -> None:
        from ember.models.vision import load_vision_spec

        spec = load_vision_spec(tokenizer.name_or_path)
        if spec is None:
            raise ValueError(f"base model {tokenizer.name_or_path!r} is not a vision-language model "
                             "(make one with `ember tiny-model --family qwen3_vl DIR`)")
        p = spec.processor
        self.image_tokens = p.get_number_of_image_patches(image_size, image_size, images_kwargs={}) // p.merge_size ** 2
        start, end = tokenizer.convert_tokens_to_ids([spec.family.start_token, spec.family.end_token])
        self.head = tokenizer.encode("colour:", add_special_tokens=False) + [start]
        self.tail = [end] + tokenizer.encode(" is", add_special_tokens=False)
        self.answers = {c: tokenizer.encode(" " + c, add_special_tokens=False) + [tokenizer.eos_token_id]
                        for c in COLOURS}

    def datum(self, example: Example, colour: str, weight: float) -> types.Datum:
        """`prompt <image> answer` as next-token SFT: only the answer's tokens weighted."""
        answer = self.answers[colour]
        seq_tail = self.tail + answer
        chunks = [types.EncodedTextChunk(tokens=self.head),
                  types.ImageChunk(data=example.png, format="png", expected_tokens=self.image_tokens),
                  types.EncodedTextChunk(tokens=seq_tail[:-1])]
        n = len(self.head) + self.image_tokens + len(seq_tail) - 1
        targets = np.zeros(n, dtype=np.int64)
        targets[n - len(seq_tail):] = seq_tail
        weights = np.zeros(n, dtype=np.float32)
        weights[n - len(answer):] = weight
        return types.Datum(model_input=types.ModelInput(chunks=chunks),
                           loss_fn_inputs={"target_tokens": targets, "weights": weights})


def accuracy(training_client, layout: Layout, examples: Sequence[Example]) -> float:
    """Share of examples whose true colour scores highest among all colours (one forward)."""
    names = list(COLOURS)
    data = [layout.datum(e, c, 1.0) for e in examples for c in names]
    out = training_client.forward(data, "cross_entropy").result()
    scores = [float(np.sum(np.asarray(o["logprobs"].data) * np.asarray(d.loss_fn_inputs["weights"].data)))
              for o, d in zip(out.loss_fn_outputs, data)]
    picks = np.asarray(scores).reshape(len(examples), len(names)).argmax(axis=1)
    return float(np.mean([names[k] == e.colour for k, e in zip(picks, examples)]))


def train_vlm_sft(training_client, layout: Layout, cfg: VLMSFTConfig, on_step: StepHook | None = None) -> float:
    """`cfg.steps` steps on fresh pictures; returns the last held-out accuracy."""
    train = make_examples(cfg.steps * cfg.batch_size, cfg.image_size, cfg.seed)
    held_out = make_examples(cfg.eval_examples, cfg.image_size, cfg.seed + 1_000_003)
    logger = get_logger()
    acc = accuracy(training_client, layout, held_out)
    with logger.prefix("vlm_sft/"):
        record_metric("accuracy_start", acc)  # before training: chance, about 1 / len(COLOURS)
        for step in range(cfg.steps):
            batch = train[step * cfg.batch_size:(step + 1) * cfg.batch_size]
            n_tokens = sum(len(layout.answers[e.colour]) for e in batch)
            with span("step"):
                fb = training_client.forward_backward([layout.datum(e, e.colour, 1.0 / n_tokens) for e in batch],
                                                      "cross_entropy")
                opt = training_client.optim_step(types.AdamParams(learning_rate=cfg.learning_rate))
                record_metric("loss", fb.result().metrics["loss:sum"])
                opt.result()
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                acc = accuracy(training_client, layout, held_out)
                record_metric("accuracy", acc)
            summary = logger.flush(step)
            if on_step is not None:
                on_step(step, summary)
    return acc


def run_vlm_sft(config: VLMSFTConfig, on_step: StepHook | None = None) -> str | None:
    """Train a LoRA adapter on the coloured shapes; returns the saved `tinker://` path (or None)."""
    from ember.recipes.common import make_service_client

    service_client = make_service_client(config.client)
    training_client = service_client.create_lora_training_client(
        base_model=config.base_model, rank=config.lora_rank, seed=config.seed).result()
    layout = Layout(training_client.get_tokenizer(), config.image_size)
    acc = train_vlm_sft(training_client, layout, config, on_step=on_step)
    print(f"ember train vlm_sft: held-out accuracy {acc:.2f} (chance {1 / len(COLOURS):.2f})", flush=True)
    if not config.save_name:
        return None
    return training_client.save_state(config.save_name).result().path
