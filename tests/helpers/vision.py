"""Images for vision-language tests: PNG bytes made in code and image datums in Tinker's
shape (`<|vision_start|>` text, an `ImageChunk`, `<|vision_end|>` text, as tinker-cookbook's
Qwen3-VL renderer writes them)."""

from __future__ import annotations

import io

import torch
from tinker import types

from ember.models.vision import load_vision_spec

COLORS = {"red": (230, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 230), "yellow": (230, 220, 20)}


def png_bytes(rgb: tuple[int, int, int], size: int = 56, *, stripe: bool = False) -> bytes:
    """A `size` x `size` PNG of one colour (with `stripe`, a white band across its top half)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), rgb)
    if stripe:
        ImageDraw.Draw(img).rectangle([0, 0, size - 1, size // 4], fill=(255, 255, 255))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def image_tokens(model_dir, size: int) -> int:
    """How many `<|image_pad|>` tokens the model makes of a `size` x `size` image (its
    processor's count, as tinker-cookbook's `image_to_chunk` computes `expected_tokens`)."""
    spec = load_vision_spec(model_dir)
    p = spec.processor
    return p.get_number_of_image_patches(size, size, images_kwargs={}) // p.merge_size ** 2


def image_datum(tok, image: bytes, prompt: str, answer: str, expected_tokens: int | None,
                weights: float = 1.0) -> types.Datum:
    """A next-token SFT datum over `prompt <image> answer`: model_input is everything but
    the last token, targets are shifted by one, only the answer is weighted."""
    start, end = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    head = tok.encode(prompt) + [start]
    tail = [end] + tok.encode(answer)
    chunks = [types.EncodedTextChunk(tokens=head),
              types.ImageChunk(data=image, format="png", expected_tokens=expected_tokens),
              types.EncodedTextChunk(tokens=tail[:-1])]
    model_input = types.ModelInput(chunks=chunks)
    n_image = expected_tokens if expected_tokens is not None else 0
    length = len(head) + n_image + len(tail) - 1
    n_answer = len(tok.encode(answer))
    targets = [0] * (length - len(tail)) + tail
    w = [0.0] * (length - n_answer) + [weights] * n_answer
    return types.Datum(model_input=model_input, loss_fn_inputs={
        "target_tokens": torch.tensor(targets, dtype=torch.int64),
        "weights": torch.tensor(w, dtype=torch.float32)})
