"""Turn Tinker datums into validated tensors, plan micro-batches, and pack them.

Packing: datums are placed into rows (first-fit decreasing) with `position_ids`
restarting at 0 for each datum and no attention mask; transformers then builds a
block-diagonal causal mask from the position ids (`masking_utils.
find_packed_sequence_indices`), so a packed sequence never attends to another. Row width:
with a dense-mask backend (sdpa, eager) a row is as wide as the longest datum of the
micro-batch, so attention never costs more than padding would while the linear layers
skip the padding; with flash-attention (varlen kernels, no T×T mask) everything goes into
one row. Leftover room in a row is filled with pad tokens forming their own segment
(positions restart at 0), which no real token can attend to and no loss reads.
`tests/engine/test_engine_packing.py` checks packed logprobs against one-sequence forwards.
Padding (`EngineConfig.packing=False`) right-pads each micro-batch to its longest datum.

Images (a vision-language model, `prepare_datums(..., vision=spec)`): each image chunk is
expanded to the model's placeholder run before anything else (`ember.models.vision`), so
lengths, budgets and the loss inputs' positions are the expanded ones, which are Tinker's
(an image chunk counts its `expected_tokens`); the laid-out micro-batch then gets its
M-RoPE positions and pixels (`ember.engine.vision_batch`, packing stays exact).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tinker import types

from ember.errors import UserError
from ember.losses import LOSSES, LossSpec, validate_datum_inputs
from ember.losses.validation import first_bad_datum
from ember.engine.vision_batch import RopeIndex, vision_kwargs
from ember.models.vision import ExpandedInput, VisionSpec, expand_model_input

_DTYPES = {"int64": torch.int64, "float32": torch.float32}


@dataclass
class PreparedDatum:
    index: int  # position in the request
    input_ids: torch.Tensor  # (N,) int64
    inputs: dict[str, torch.Tensor]  # validated loss inputs, first dim N
    vision: ExpandedInput | None = None  # its images (a vision-language model's datum with image chunks)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class MicroBatch:
    datum_indices: list[int]  # request positions, in order
    lengths: list[int]
    input_ids: torch.Tensor  # (rows, width)
    position_ids: torch.Tensor  # same shape as input_ids
    attention_mask: torch.Tensor | None  # None when packed
    valid_index: torch.Tensor  # flat indices of the real tokens in (B*L), datum by datum
    inputs: dict[str, torch.Tensor]  # loss inputs concatenated over the T real tokens
    segment_ids: torch.Tensor  # (T,) datum index within this micro-batch
    # images (`ember.engine.vision_batch`): pixel_values, image_grid_thw, mm_token_type_ids;
    # position_ids then has 4 rows (text, then M-RoPE time/height/width)
    model_kwargs: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


def _model_input_ids(index: int, datum: types.Datum, vocab_size: int, scan: bool = True) -> torch.Tensor:
    for j, chunk in enumerate(datum.model_input.chunks):
        if not isinstance(chunk, types.EncodedTextChunk):
            raise UserError(
                f"datum {index}: model_input chunk {j} is of type {getattr(chunk, 'type', type(chunk).__name__)!r}; "
                "this engine serves text-only models (encoded_text chunks)"
            )
    ids = torch.tensor(datum.model_input.to_ints(), dtype=torch.int64)
    if ids.numel() == 0:
        raise UserError(f"datum {index}: model_input is empty; at least one token is required")
    bad = ((ids < 0) | (ids >= vocab_size)) if scan else None
    if bad is not None and bad.any():
        pos = int(bad.nonzero()[0, 0])
        raise UserError(
            f"datum {index}: model_input token {int(ids[pos])} at position {pos} is outside the "
            f"vocabulary [0, {vocab_size})"
        )
    return ids


def _datum_ids(index: int, datum: types.Datum, vocab_size: int, vision: VisionSpec | None,
               scan: bool = True) -> tuple[torch.Tensor, ExpandedInput | None]:
    """The datum's token ids, its image chunks expanded when the model takes images."""
    if vision is None or all(isinstance(c, types.EncodedTextChunk) for c in datum.model_input.chunks):
        return _model_input_ids(index, datum, vocab_size, scan), None
    expanded = expand_model_input(datum.model_input, vision, where=f"datum {index}")
    text = types.Datum(model_input=types.ModelInput.from_ints(expanded.input_ids.tolist()), loss_fn_inputs={})
    return _model_input_ids(index, text, vocab_size, scan), expanded


def _loss_input_tensors(index: int, datum: types.Datum) -> dict[str, torch.Tensor]:
    out = {}
    for key, td in datum.loss_fn_inputs.items():
        dtype = str(td.dtype)
        if dtype not in _DTYPES:
            raise UserError(
                f"datum {index}: loss_fn_inputs[{key!r}] has dtype {dtype!r}; expected 'int64' or 'float32'"
            )
        try:
            out[key] = td.to_torch()
        except Exception as exc:  # malformed shape/data, bad sparse indices
            raise UserError(f"datum {index}: loss_fn_inputs[{key!r}] cannot be read as a tensor: {exc}") from exc
    return out


OUTPUT_NAMES = {"logprobs": "a policy head", "values": "a value head"}


def head_mismatch(spec: LossSpec, output: str) -> str:
    """The error for a loss that does not consume what this run's head outputs."""
    fits = ", ".join(sorted(n for n, s in LOSSES.items() if output in s.consumes))
    consumed = " and ".join(sorted(spec.consumes))
    if output == "values":
        what = ("this run has a value head (user_metadata {'ember.head': 'value'}): "
                "its per-token outputs are values")
    else:
        what = "this run has a policy head: its per-token outputs are log-probs of the targets"
    note = " (cross_entropy is linear; forward_backward_custom uses it)" if output == "values" else ""
    return f"loss_fn {spec.name!r} consumes {consumed}, but {what}. Losses for {OUTPUT_NAMES[output]}: {fits}{note}."


def prepare_datums(
    datums: Sequence[types.Datum], spec: LossSpec, vocab_size: int, output: str = "logprobs",
    vision: VisionSpec | None = None,
) -> list[PreparedDatum]:
    """Validate every datum before any compute (so a bad datum never leaves half a gradient).

    ``output`` is what the run's head computes per token (``"logprobs"`` for a policy,
    ``"values"`` for a value head); a loss that does not consume it is refused first.
    Keys, shapes and dtypes are checked datum by datum; the value scans (token ids in the
    vocabulary, finite floats) run once per field over the whole request, and the first
    datum they flag is re-validated in full for its error message. On a value head
    ``target_tokens`` are checked (the SDK's custom-loss path sends them) but dropped.
    ``vision`` (a vision-language model's `VisionSpec`) expands image chunks; without it an
    image chunk is refused."""
    if output not in OUTPUT_NAMES:
        raise ValueError(f"head output must be one of {sorted(OUTPUT_NAMES)}, got {output!r}")
    if output not in spec.consumes:
        raise UserError(head_mismatch(spec, output))
    if len(datums) == 0:
        raise UserError("forward_backward needs at least one datum; got an empty list")
    prepared = []
    for i, datum in enumerate(datums):
        ids, expanded = _datum_ids(i, datum, vocab_size, vision, scan=False)
        inputs = validate_datum_inputs(spec.name, i, int(ids.shape[0]), _loss_input_tensors(i, datum), vocab_size,
                                       scan_values=False)
        prepared.append(PreparedDatum(index=i, input_ids=ids, inputs=inputs, vision=expanded))
    _scan_values(datums, prepared, spec, vocab_size)
    return _check_targets(prepared, output)


def _check_targets(prepared: list[PreparedDatum], output: str) -> list[PreparedDatum]:
    with_targets = [p for p in prepared if "target_tokens" in p.inputs]
    if output == "values":
        for p in with_targets:
            shape = tuple(p.inputs["target_tokens"].shape)
            if len(shape) != 1:
                raise UserError(
                    f"datum {p.index}: loss_fn_inputs['target_tokens'] has shape {shape}; a value head "
                    f"has one output per position, use ({shape[0]},)"
                )
            del p.inputs["target_tokens"]  # a value head reads no targets
        return prepared
    ranks = {p.inputs["target_tokens"].dim() for p in with_targets}
    if len(ranks) > 1:
        raise UserError("all datums of one request must have target_tokens of the same rank ((N,) or (N, K))")
    return prepared


def _scan_values(datums: Sequence[types.Datum], prepared: list[PreparedDatum], spec: LossSpec,
                 vocab_size: int) -> None:
    """Raise the per-datum error of the first datum with a bad value, if any."""
    first = first_bad_datum([{**p.inputs, "model_input": p.input_ids} for p in prepared], vocab_size)
    if first is not None:
        ids = prepared[first].input_ids
        bad = (ids < 0) | (ids >= vocab_size)
        if bad.any():
            pos = int(bad.nonzero()[0, 0])
            raise UserError(f"datum {first}: model_input token {int(ids[pos])} at position {pos} is outside the "
                             f"vocabulary [0, {vocab_size})")
        validate_datum_inputs(spec.name, first, int(ids.shape[0]), _loss_input_tensors(first, datums[first]),
                              vocab_size)
        raise AssertionError(f"datum {first}: the batched value scan and the per-datum checks disagree")


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Greedy, order-preserving: consecutive datums while their tokens fit the budget."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if current and used + n > token_budget:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        groups.append(current)
    return groups


def _concat_inputs(items: Sequence[PreparedDatum]) -> dict[str, torch.Tensor]:
    keys = items[0].inputs.keys()
    return {k: torch.cat([d.inputs[k] for d in items], dim=0) for k in keys}


def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """First-fit decreasing bin packing of item indices into rows of `width` tokens."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    return rows


def _packed_layout(items: Sequence[PreparedDatum], width: int, pad_id: int):
    lengths = [d.num_tokens for d in items]
    rows = pack_rows(lengths, width)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    position_ids = torch.zeros((len(rows), width), dtype=torch.int64)
    starts = [0] * len(items)  # flat offset of each item
    for r, row in enumerate(rows):
        col = 0
        for i in row:
            n = lengths[i]
            input_ids[r, col : col + n] = items[i].input_ids
            position_ids[r, col : col + n] = torch.arange(n)
            starts[i] = r * width + col
            col += n
        position_ids[r, col:] = torch.arange(width - col)  # the pad segment
    valid_index = torch.cat([torch.arange(starts[i], starts[i] + lengths[i]) for i in range(len(items))])
    return input_ids, position_ids, valid_index


def _padded_layout(items: Sequence[PreparedDatum], pad_id: int):
    width = max(d.num_tokens for d in items)
    input_ids = torch.full((len(items), width), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(items), width), dtype=torch.int64)
    for row, d in enumerate(items):
        input_ids[row, : d.num_tokens] = d.input_ids
        attention_mask[row, : d.num_tokens] = 1
    position_ids = torch.arange(width).expand(len(items), width).clone()
    return input_ids, position_ids, attention_mask, attention_mask.flatten().nonzero().squeeze(1)


def build_micro_batch(
    items: Sequence[PreparedDatum], packed: bool, pad_id: int = 0, single_row: bool = False,
    rope_index: RopeIndex | None = None,
) -> MicroBatch:
    """Lay out one micro-batch; `single_row` packs everything in one row (varlen attention).
    With images among the items, `rope_index` (the model's M-RoPE) places them
    (`ember.engine.vision_batch`)."""
    lengths = [d.num_tokens for d in items]
    segment_ids = torch.repeat_interleave(torch.arange(len(items)), torch.tensor(lengths))
    attention_mask = None
    if packed:
        width = sum(lengths) if single_row else max(lengths)
        input_ids, position_ids, valid_index = _packed_layout(items, width, pad_id)
    else:
        input_ids, position_ids, attention_mask, valid_index = _padded_layout(items, pad_id)
    model_kwargs: dict[str, torch.Tensor] = {}
    if any(d.vision is not None for d in items):
        if rope_index is None:
            raise ValueError("a micro-batch with images needs the model's M-RoPE (rope_index)")
        position_ids, model_kwargs = vision_kwargs(position_ids, valid_index, lengths, [d.vision for d in items],
                                                   rope_index)
    return MicroBatch(
        datum_indices=[d.index for d in items],
        lengths=lengths,
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        valid_index=valid_index,
        inputs=_concat_inputs(items),
        segment_ids=segment_ids,
        model_kwargs=model_kwargs,
    )


def block_causal_mask(position_ids: torch.Tensor, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """The additive (rows, 1, width, width) mask of packed rows: a token attends to the
    tokens before it in its own sequence (a new one starts where position_ids restart at 0),
    what transformers derives from position_ids for the families that do
    (`ModelFamily.packs_by_position`); with `window`, only to the last `window` of them
    (a sliding-window layer: q - k < window, transformers' rule). 0 where attended,
    dtype's minimum elsewhere."""
    segment = (position_ids == 0).cumsum(dim=-1)
    width = position_ids.shape[-1]
    index = torch.arange(width, device=position_ids.device)
    distance = index[:, None] - index[None, :]
    allowed = (segment[:, :, None] == segment[:, None, :]) & (distance >= 0)
    if window is not None:
        allowed &= distance < window
    zero = torch.zeros((), dtype=dtype, device=position_ids.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]


def packed_masks(position_ids: torch.Tensor, dtype: torch.dtype, config) -> torch.Tensor | dict[str, torch.Tensor]:
    """`block_causal_mask` for a model's layers: one tensor when every layer attends fully,
    else one per layer type (`config.layer_types`), the form transformers' models take
    prepared masks in (a sliding-window layer gets `config.sliding_window`)."""
    full = block_causal_mask(position_ids, dtype)
    types_ = set(getattr(config, "layer_types", None) or ())
    if types_ <= {"full_attention"}:
        return full
    masks = {"full_attention": full}
    if "sliding_attention" in types_:
        masks["sliding_attention"] = block_causal_mask(position_ids, dtype, int(config.sliding_window))
    unknown = types_ - set(masks)
    if unknown:
        raise ValueError(f"packed micro-batches: no mask for layer types {sorted(unknown)}; "
                         "set EngineConfig.packing=False for this model")
    return masks
