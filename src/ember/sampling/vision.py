"""Image prompts in TorchSampler: what a prefill needs besides token ids, and how the
prefix cache tells images apart (docs/architecture.md, "Images").

A prompt's image chunks are expanded by the model's own rules
(`ember.models.vision.expand_model_input`: one `<|image_pad|>` per merged patch, Tinker's
counting, `expected_tokens` checked) when the request is submitted, off the worker
thread. What the sampler keeps of it is a `PromptImages`:

* the pixel values and grids the vision tower reads at prefill;
* the M-RoPE positions (3 x P, the model's own `get_rope_index`) and their `delta`: a
  token decoded at cache position i has M-RoPE position i + delta in all three parts
  (what transformers' `generate` does with `rope_deltas`);
* each image's placeholder run and the SHA-256 of its bytes. The prefix cache keys a
  prompt by `cache_prompt`: the token ids with every position of an image's run replaced
  by that image's interned id (`ImageIds`: one negative id per distinct digest), so two
  different images never share an entry while the same image in the same place does.

A cache hit never ends inside an image run (`safe_hit`): the vision tower encodes whole
images, so the forward after a hit carries every image that starts at or after it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from tinker import types

from ember.errors import UserError
from ember.models.images import image_digest
from ember.models.vision import VisionSpec, expand_model_input, is_image_chunk


@dataclass(frozen=True, eq=False)
class PromptImages:
    pixel_values: torch.Tensor  # (patches of all images, dim) float32
    grid_thw: torch.Tensor  # (images, 3) int64
    mm_token_type_ids: torch.Tensor  # (P,) int32: 0 text, 1 image
    mrope: torch.Tensor  # (3, P) int64
    delta: int  # M-RoPE position of cache position i (after the prompt) = i + delta
    runs: tuple[tuple[int, int], ...]  # each image's [start, end) in the prompt
    digests: tuple[str, ...]  # each image's SHA-256

    def safe_hit(self, hit: int) -> int:
        """`hit` lowered to the start of an image run it would cut."""
        for start, end in self.runs:
            if start < hit < end:
                return start
        return hit

    def cache_prompt(self, prompt: tuple[int, ...], ids: "ImageIds") -> tuple[int, ...]:
        out = list(prompt)
        for (start, end), digest in zip(self.runs, self.digests):
            out[start:end] = [ids.id_of(digest)] * (end - start)
        return tuple(out)

    def forward_kwargs(self, start: int, device: torch.device, dtype: torch.dtype) -> dict:
        """The vision arguments of a forward over prompt[start:] (`start` never inside a
        run): the images starting at or after it, their types and 4-row position ids
        (row 0 the cache positions, rows 1-3 M-RoPE)."""
        first = sum(1 for s, _ in self.runs if s < start)
        patches = self.grid_thw.prod(dim=1)
        offset = int(patches[:first].sum())
        kwargs: dict = {"mm_token_type_ids": self.mm_token_type_ids[start:][None].to(device)}
        if first < len(self.runs):
            kwargs["pixel_values"] = self.pixel_values[offset:].to(device=device, dtype=dtype)
            kwargs["image_grid_thw"] = self.grid_thw[first:].to(device)
        text = torch.arange(start, self.mrope.shape[1])[None]
        kwargs["position_ids"] = torch.cat([text, self.mrope[:, start:]])[:, None].to(device)
        return kwargs


class ImageIds:
    """Digest -> a negative id (never a token id), the same for the same bytes. Bounded:
    past `max_ids` distinct images the table starts again, and `generation` tells the
    prefix cache to drop every entry keyed by the old ids."""

    def __init__(self, max_ids: int = 65536) -> None:
        self.max_ids = max_ids
        self.generation = 0
        self._ids: dict[str, int] = {}
        self._lock = threading.Lock()

    def id_of(self, digest: str) -> int:
        with self._lock:
            if digest not in self._ids and len(self._ids) >= self.max_ids:
                self._ids.clear()
                self.generation += 1
            return self._ids.setdefault(digest, -1 - len(self._ids))


def has_images(prompt: types.ModelInput) -> bool:
    return isinstance(prompt, types.ModelInput) and any(is_image_chunk(c) for c in prompt.chunks)


def check_no_placeholders(prompt: types.ModelInput, spec: VisionSpec) -> None:
    """A text chunk of an image prompt must not hold the image placeholder id: the model
    finds an image's positions by that id, so a stray one would take the image's features
    (transformers raises on the count mismatch inside the forward)."""
    for j, chunk in enumerate(prompt.chunks):
        if not is_image_chunk(chunk) and spec.image_token_id in chunk.tokens:
            raise UserError(f"prompt: chunk {j} (encoded_text) holds the image placeholder token "
                             f"{spec.image_token_id}; images go in image chunks")


def expand_prompt(prompt: types.ModelInput, spec: VisionSpec, model) -> tuple[types.ModelInput, PromptImages]:
    """(the prompt as token ids, its images) of a prompt holding image chunks; ValueError
    (naming the chunk) for an image the model cannot take or a wrong `expected_tokens`."""
    check_no_placeholders(prompt, spec)
    ex = expand_model_input(prompt, spec, where="prompt")
    ids = ex.input_ids[None]
    mm = ex.mm_token_type_ids[None]
    with torch.no_grad():
        mrope, delta = model.model.get_rope_index(ids, mm, ex.image_grid_thw)
    runs, digests, pos = [], [], 0
    for chunk in prompt.chunks:
        if is_image_chunk(chunk):
            n = spec.token_count(ex.image_grid_thw[len(runs)])
            runs.append((pos, pos + n))
            digests.append(image_digest(chunk.data))
            pos += n
        else:
            pos += chunk.length
    images = PromptImages(pixel_values=ex.pixel_values, grid_thw=ex.image_grid_thw,
                          mm_token_type_ids=ex.mm_token_type_ids, mrope=mrope[:, 0].to(torch.int64),
                          delta=int(delta.reshape(-1)[0]), runs=tuple(runs), digests=tuple(digests))
    return types.ModelInput.from_ints(ex.input_ids.tolist()), images
