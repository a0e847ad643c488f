"""Images in a micro-batch: each sequence keeps its own pixel values, grid and M-RoPE
(docs/architecture.md#images).

A vision-language datum arrives expanded (`ember.models.vision.expand_model_input`: its
image chunks are `<|image_pad|>` runs, its `ExpandedInput` holds the pixels). Laid out by
`ember.engine.batching` like text (packed rows or padded rows), the micro-batch then gets:

* position ids of shape (4, rows, width): row 0 the text positions the layout made
  (restarting at 0 per sequence, so packing's block-diagonal mask is built from them as
  for text), rows 1-3 the M-RoPE (time, height, width) positions, computed per sequence
  by the model's own `get_rope_index` and written at that sequence's places. A text
  sequence's M-RoPE is its text position on all three axes, which the copy already holds.
  So packing with images is exact: each sequence sees the positions it would alone.
* `pixel_values` / `image_grid_thw` of the images in the order their placeholder tokens
  appear in the row-major layout (the order the model scatters image features into), and
  `mm_token_type_ids` (rows, width).

The vision tower attends within each image (`cu_seqlens` per grid), so batching images
from several sequences changes nothing either (`tests/engine/test_engine_vision.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ember.models.vision import ExpandedInput

# (expanded sequence) -> its M-RoPE positions, (3, N) int64
RopeIndex = Callable[[ExpandedInput], torch.Tensor]


def model_rope_index(model) -> RopeIndex:
    """`RopeIndex` from a Qwen-VL model's `get_rope_index` (the transformers model that
    holds it: `Qwen3VLModel`, `Qwen2_5_VLModel`, under the `*ForConditionalGeneration`)."""
    inner = model.model

    def rope(ex: ExpandedInput) -> torch.Tensor:
        with torch.no_grad():
            pos, _ = inner.get_rope_index(ex.input_ids[None], mm_token_type_ids=ex.mm_token_type_ids[None],
                                          image_grid_thw=ex.image_grid_thw)
        return pos[:, 0, :].to(torch.int64)

    return rope


def vision_kwargs(position_ids: torch.Tensor, valid_index: torch.Tensor, lengths: Sequence[int],
                  expanded: Sequence[ExpandedInput | None], rope_index: RopeIndex) -> tuple[torch.Tensor, dict]:
    """(4-row position ids, the model's vision keyword arguments) of one laid-out micro-batch.

    `position_ids` (rows, width) and `valid_index` (flat places of the real tokens, sequence
    by sequence) are the layout's; `expanded[k]` is sequence k's images (None: text only)."""
    rows, width = position_ids.shape
    pos = position_ids.unsqueeze(0).repeat(4, 1, 1)
    spatial = pos[1:].view(3, rows * width)
    token_types = torch.zeros(rows * width, dtype=torch.int32)
    starts = torch.tensor([0, *lengths]).cumsum(0).tolist()
    first_place = {}
    for k, ex in enumerate(expanded):
        if ex is None or ex.pixel_values is None:
            continue
        places = valid_index[starts[k]: starts[k + 1]]
        spatial[:, places] = rope_index(ex)
        token_types[places] = ex.mm_token_type_ids
        first_place[k] = int(places[0])
    order = sorted(first_place, key=first_place.__getitem__)  # the layout's order of the sequences
    kwargs = {
        "pixel_values": torch.cat([expanded[k].pixel_values for k in order]),
        "image_grid_thw": torch.cat([expanded[k].image_grid_thw for k in order]),
        "mm_token_type_ids": token_types.view(rows, width),
    }
    return pos, kwargs
