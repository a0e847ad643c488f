"""Image chunks of a Tinker `ModelInput` → what a vision-language model consumes.

    spec = load_vision_spec(model_dir)             # None for a text-only model
    ex = expand_model_input(model_input, spec, where="datum 3")            # decodes the chunks
    ex = expand_model_input(model_input, spec, where="prompt", images=[pil_image, ...])  # decoded already
    model(input_ids=ex.input_ids[None], mm_token_type_ids=ex.mm_token_type_ids[None],
          pixel_values=ex.pixel_values, image_grid_thw=ex.image_grid_thw)

Counting is Tinker's (docs/architecture.md#images): an image chunk stands for exactly
`expected_tokens` positions of the `ModelInput` — the model's `<|image_pad|>` run, one
token per merged patch (tinker-cookbook's `image_to_chunk`: patches // merge_size**2).
The `<|vision_start|>` / `<|vision_end|>` around it are ordinary text tokens that the
renderer writes (tinker-cookbook's Qwen3-VL renderer does), as the chat template's
`<|vision_start|><|image_pad|><|vision_end|>` has the processor expand only the pad. So
`ModelInput.length` and the positions `loss_fn_inputs` line up with are unchanged by the
expansion. `expected_tokens` given and different from the model's count is a user error
naming `where`, the chunk index, both counts.

Images are decoded before they get here, bounded (`decode_image_chunk`, the one place an
image chunk's bytes become pixels); the image processor is the model's own, saved
beside it (`preprocessor_config.json`), loaded with the PIL backend (no torchvision).
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tinker import types

from ember.errors import UserError
from ember.models.families import VisionFamily, vision_of

IMAGE_CHUNK_TYPES = (types.ImageChunk, types.ImageAssetPointerChunk)


@dataclass(frozen=True)
class VisionSpec:
    """A vision-language model's input side: its image processor and placeholder ids."""

    family: VisionFamily
    processor: Any  # transformers' image processor (PIL backend)
    image_token_id: int
    merge_size: int

    def encode(self, image) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values (patches, dim) float32, image_grid_thw (1, 3) int64) of one image."""
        out = self.processor(images=[image], return_tensors="pt")
        return out["pixel_values"].to(torch.float32), out["image_grid_thw"].to(torch.int64)

    def token_count(self, grid_thw: torch.Tensor) -> int:
        """The `<|image_pad|>` run of an image: its patches // merge_size**2."""
        return int(grid_thw.prod()) // (self.merge_size ** 2)

    def token_count_of_size(self, width: int, height: int) -> int | None:
        """The `<|image_pad|>` run of a `width` x `height` image from its size alone (the
        processor's own `get_number_of_image_patches`, the resize `encode` does), so a
        request's counts are checked before any image is decoded; None for a processor
        without it (then only `encode` counts)."""
        count = getattr(self.processor, "get_number_of_image_patches", None)
        if count is None:
            return None
        return int(count(height, width, images_kwargs={})) // (self.merge_size ** 2)


@dataclass(frozen=True)
class ExpandedInput:
    """One `ModelInput` with its images expanded (`expand_model_input`)."""

    input_ids: torch.Tensor  # (N,) int64; N = ModelInput.length, images as placeholder runs
    mm_token_type_ids: torch.Tensor  # (N,) int32: 0 text, 1 image (the M-RoPE grouping)
    pixel_values: torch.Tensor | None  # (patches, dim) float32, the images in chunk order; None: no image
    image_grid_thw: torch.Tensor | None  # (images, 3) int64

    @property
    def num_images(self) -> int:
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.shape[0])

    def model_kwargs(self) -> dict[str, torch.Tensor]:
        """The vision keyword arguments of a one-sequence forward ({} without an image)."""
        if self.pixel_values is None:
            return {}
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw,
                "mm_token_type_ids": self.mm_token_type_ids[None]}


def load_vision_spec(model_dir: str | os.PathLike, config: Any = None) -> VisionSpec | None:
    """The vision side of the model in `model_dir` (None for a text-only model)."""
    from transformers import AutoConfig, AutoImageProcessor

    config = config if config is not None else AutoConfig.from_pretrained(model_dir, local_files_only=True)
    family = vision_of(config)
    if family is None:
        return None
    processor = AutoImageProcessor.from_pretrained(Path(model_dir), local_files_only=True, backend="pil")
    return VisionSpec(family=family, processor=processor, image_token_id=int(config.image_token_id),
                      merge_size=int(config.vision_config.spatial_merge_size))


def is_image_chunk(chunk: Any) -> bool:
    return isinstance(chunk, IMAGE_CHUNK_TYPES)


def decode_image_chunk(chunk: Any, where: str, index: int):
    """An image chunk's pixels as an RGB `PIL.Image` (a user error naming `where` and the
    chunk when it cannot be). `ImageAssetPointerChunk`s are resolved to bytes before they
    reach a model (under the operator's image root), so one arriving here is refused."""
    from PIL import Image

    if not isinstance(chunk, types.ImageChunk):
        raise UserError(f"{where}: model_input chunk {index} is an image_asset_pointer; this server does not "
                         "resolve image locations here (send the image bytes as an `image` chunk)")
    try:
        with Image.open(io.BytesIO(chunk.data)) as img:
            img.load()
            return img.convert("RGB")
    except Exception as exc:  # PIL raises many types for bad bytes
        raise UserError(f"{where}: model_input chunk {index} ({chunk.format} image) cannot be decoded: {exc}") from exc


def _image_size(image) -> tuple[int, int]:
    if isinstance(image, np.ndarray):
        return int(image.shape[1]), int(image.shape[0])
    return image.size


def _check_expected(where: str, index: int, chunk: Any, count: int, image, grid: torch.Tensor,
                    merge: int) -> None:
    expected = chunk.expected_tokens
    if expected is not None and int(expected) != count:
        w, h = _image_size(image)
        t, gh, gw = (int(x) for x in grid[0])
        raise UserError(
            f"{where}: model_input chunk {index} (image) has expected_tokens={expected}, but this model makes "
            f"{count} tokens of it (a {w}x{h} image -> {t}x{gh}x{gw} patches, merged {merge}x{merge})")


def check_image_size_tokens(spec: VisionSpec, chunk: Any, width: int, height: int, where: str,
                            index: int) -> int | None:
    """`check_image_tokens` from the image's declared size, nothing decoded (None: this
    processor counts only from pixels, `check_image_tokens` then)."""
    count = spec.token_count_of_size(width, height)
    expected = chunk.expected_tokens
    if count is not None and expected is not None and int(expected) != count:
        raise ValueError(f"{where}: model_input chunk {index} (image) has expected_tokens={expected}, but this model "
                         f"makes {count} tokens of it (a {width}x{height} image, merged "
                         f"{spec.merge_size}x{spec.merge_size})")
    return count


def check_image_tokens(spec: VisionSpec, chunk: Any, image: Any, where: str, index: int) -> int:
    """The number of placeholder tokens the model makes of `image`; UserError (naming
    `where`, the chunk index, expected and computed) when the chunk's `expected_tokens`
    says otherwise. The service calls it when a request arrives, the expansion again."""
    _, grid = spec.encode(image)
    count = spec.token_count(grid)
    _check_expected(where, index, chunk, count, image, grid, spec.merge_size)
    return count


def expand_model_input(model_input: types.ModelInput, spec: VisionSpec, where: str,
                       images: Sequence[Any] | None = None) -> ExpandedInput:
    """Expand each image chunk of `model_input` to the model's placeholder run.

    `images`: the decoded images (RGB `PIL.Image` or (H, W, 3) uint8 arrays), one per image
    chunk in order; None decodes them here (`decode_image_chunk`). `where` names the
    input in errors ("datum 3", "prompt"). Text chunks pass through unchanged."""
    image_chunks = [j for j, c in enumerate(model_input.chunks) if is_image_chunk(c)]
    if images is not None and len(images) != len(image_chunks):
        raise ValueError(f"{where}: {len(image_chunks)} image chunks but {len(images)} decoded images")
    ids: list[torch.Tensor] = []
    types_: list[torch.Tensor] = []
    pixels: list[torch.Tensor] = []
    grids: list[torch.Tensor] = []
    for j, chunk in enumerate(model_input.chunks):
        if not is_image_chunk(chunk):
            tokens = torch.tensor(list(chunk.tokens), dtype=torch.int64)
            ids.append(tokens)
            types_.append(torch.zeros(tokens.shape[0], dtype=torch.int32))
            continue
        image = images[len(pixels)] if images is not None else decode_image_chunk(chunk, where, j)
        pv, grid = spec.encode(image)
        count = spec.token_count(grid)
        _check_expected(where, j, chunk, count, image, grid, spec.merge_size)
        ids.append(torch.full((count,), spec.image_token_id, dtype=torch.int64))
        types_.append(torch.ones(count, dtype=torch.int32))
        pixels.append(pv)
        grids.append(grid)
    return ExpandedInput(
        input_ids=torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64),
        mm_token_type_ids=torch.cat(types_) if types_ else torch.zeros(0, dtype=torch.int32),
        pixel_values=torch.cat(pixels) if pixels else None,
        image_grid_thw=torch.cat(grids) if grids else None,
    )
