"""Resolving a datum's provenance spans against stability records (`stable_reinforce`).

``model_input_spans`` tile the datum's input tokens and ``loss_fn_input_spans`` tile
``loss_fn_inputs["target_tokens"]``, run after run in order (``Datum.with_provenance``).
A run claims that its positions hold tokens ``[offset, offset + length)`` of the named
sequence's prompt (`PromptProvenanceSpan`) or sampled tokens (`SampledProvenanceSpan`);
ember checks that claim token by token, with one exception: a prompt run of
``loss_fn_input_spans`` may hold any token ids (placeholders), because prompt positions
carry no loss (no sampler log-prob exists there; ``sampled_mask`` is 0). tinker-cookbook's
``rl_loop`` sends zeros there (``[0] * ob_len + sampled_tokens``). Every input token and
every sampled target, whose recorded log-prob the loss uses, must equal the record. See
`ember.service.stability` for what is recorded and which choices are ember's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from tinker import types

from ember.service.api import UserError

if TYPE_CHECKING:
    from ember.service.stability import StabilityRecords

HOW = ("attach it with Datum.with_provenance(model_input=[...], loss_fn_inputs=[...]) naming the "
       "sequence_ids of samples from a sampling client with record_stability_info=True")


def _input_ids(index: int, datum: types.Datum) -> np.ndarray:
    if not all(isinstance(c, types.EncodedTextChunk) for c in datum.model_input.chunks):
        raise UserError(f"datum {index}: model_input_spans: provenance needs a model_input of token "
                        "chunks only (it holds image or dmel chunks)")
    return np.asarray(datum.model_input.to_ints(), dtype=np.int64)


def _target_ids(index: int, datum: types.Datum) -> np.ndarray:
    td = datum.loss_fn_inputs.get("target_tokens")
    if td is None:
        raise UserError(f"datum {index}: loss_fn_inputs is missing 'target_tokens', required by stable_reinforce")
    arr = np.asarray(td.to_numpy())
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise UserError(f"datum {index}: loss_fn_inputs['target_tokens'] must be int64 of shape (N,) for "
                        f"stable_reinforce, got dtype {arr.dtype} shape {tuple(arr.shape)}")
    return arr.astype(np.int64)


def _check_tiling(index: int, field: str, spans: list, n: int, what: str) -> None:
    total = sum(int(s.length) for s in spans)
    if total != n:
        raise UserError(f"datum {index}: {field}: the runs cover {total} positions but {what} has {n}; "
                        "the runs must tile it exactly")


def _span_source(records: "StabilityRecords", owner: str, session_id: str, where: str,
                 span) -> tuple[np.ndarray, np.ndarray | None]:
    """(recorded token ids, recorded log-probs or None) that `span` points into, sliced."""
    rec = records.lookup(owner, session_id, span.sequence_id, where)
    if isinstance(span, types.SampledProvenanceSpan):
        ids, logprobs, what = rec.tokens, rec.logprobs, "sampled tokens"
    else:
        if rec.prompt is None:
            raise UserError(f"{where}: the prompt of sequence_id {span.sequence_id!r} had non-token chunks; "
                            "a PromptProvenanceSpan cannot point into it")
        ids, logprobs, what = rec.prompt, None, "prompt tokens"
    end = int(span.offset) + int(span.length)
    if end > ids.size:
        raise UserError(f"{where}: offset {span.offset} + length {span.length} = {end} exceeds the {ids.size} "
                        f"recorded {what} of sequence_id {span.sequence_id!r}")
    part = slice(int(span.offset), end)
    return ids[part], (None if logprobs is None else logprobs[part])


def _match(where: str, got: np.ndarray, want: np.ndarray, start: int, span) -> None:
    diff = np.nonzero(got != want)[0]
    if diff.size:
        d = int(diff[0])
        kind = "sampled" if isinstance(span, types.SampledProvenanceSpan) else "prompt"
        raise UserError(f"{where}: tokens do not match the record of sequence_id {span.sequence_id!r}: "
                        f"position {start + d} holds {int(got[d])}, the recorded {kind} token "
                        f"{int(span.offset) + d} is {int(want[d])}")


def _walk(records, owner, session_id, index: int, field: str, spans: list, tokens: np.ndarray,
          q_T: np.ndarray | None, mask_T: np.ndarray | None) -> None:
    """Check every run of `field` against the records; fill q/mask (for the loss rows).

    With `q_T` given (the target rows), a prompt run's tokens are placeholders and are not
    compared (see the module docstring); its range is still checked against the record."""
    pos = 0
    for j, span in enumerate(spans):
        where = f"datum {index}: {field}[{j}]"
        ids, logprobs = _span_source(records, owner, session_id, where, span)
        end = pos + int(span.length)
        if q_T is None or isinstance(span, types.SampledProvenanceSpan):
            _match(where, tokens[pos:end], ids, pos, span)
        if q_T is not None and logprobs is not None:
            q_T[pos:end] = logprobs
            mask_T[pos:end] = 1.0
        pos = end


def check_model_input(records: "StabilityRecords", owner: str, session_id: str, index: int,
                      datum: types.Datum) -> list:
    """The datum's ``model_input_spans``, checked: they tile its input and every token
    equals the record it names (as for `resolve_datum`); routing replay's matching."""
    spans, inputs = list(datum.model_input_spans), _input_ids(index, datum)
    _check_tiling(index, "model_input_spans", spans, inputs.size, "model_input")
    _walk(records, owner, session_id, index, "model_input_spans", spans, inputs, None, None)
    return spans


def resolve_datum(records: "StabilityRecords", owner: str, session_id: str, index: int,
                  datum: types.Datum) -> types.Datum:
    """`datum` with loss inputs ``logprobs`` (recorded q) and ``sampled_mask`` from its provenance."""
    if datum.model_input_spans is None or datum.loss_fn_input_spans is None:
        raise UserError(f"datum {index}: stable_reinforce needs provenance, and this datum has none: {HOW}")
    model_spans, loss_spans = list(datum.model_input_spans), list(datum.loss_fn_input_spans)
    inputs, targets = _input_ids(index, datum), _target_ids(index, datum)
    _check_tiling(index, "model_input_spans", model_spans, inputs.size, "model_input")
    _check_tiling(index, "loss_fn_input_spans", loss_spans, targets.size, "loss_fn_inputs['target_tokens']")
    q_T = np.zeros(targets.size, dtype=np.float32)
    mask_T = np.zeros(targets.size, dtype=np.float32)
    _walk(records, owner, session_id, index, "model_input_spans", model_spans, inputs, None, None)
    _walk(records, owner, session_id, index, "loss_fn_input_spans", loss_spans, targets, q_T, mask_T)
    loss_inputs = dict(datum.loss_fn_inputs)
    loss_inputs["logprobs"] = types.TensorData.from_numpy(q_T)
    loss_inputs["sampled_mask"] = types.TensorData.from_numpy(mask_T)
    return types.Datum(model_input=datum.model_input, loss_fn_inputs=loss_inputs)
