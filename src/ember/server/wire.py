"""Tinker wire formats <-> `tinker.types`: pure functions, no HTTP, no service.

The schema is the SDK's own `tinker.proto.tinker_public_pb2` (docs/protocol.md §4.3-4.6):

* `ForwardBackwardRequest` (protobuf, optionally zstd) -> the service's typed
  `ForwardBackwardRequest` (`ember.service.requests`, a plain dataclass) holding
  `list[types.Datum]` with dense `TensorData` (sparse CSR is densified here, so nothing
  below the server ever sees the wire's sparse layout).
* `types.ForwardBackwardOutput` -> protobuf `ForwardBackwardOutput` (ArrayRecords of
  BatchedTensors with byte offsets and `trailing_shape`).
* `types.SampleResponse` -> protobuf `SampleResponse` (NaN for missing prompt logprobs,
  top-k rows padded with the sentinel `(0, -99999.0)`).

Malformed input raises `WireError` (a `ValueError`) naming the datum index and field, with
expected vs got; the HTTP layer turns it into a 400 with a JSON body.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.types.topk_logprobs import TopkLogprobs

from ember.metrics.keys import sdk_metric_key as metric_key  # wire.metric_key: the key a response carries
from ember.service.requests import ForwardBackwardRequest

PROTOBUF_CONTENT_TYPE = "application/x-protobuf"
TOPK_SENTINEL_TOKEN = 0
TOPK_SENTINEL_LOGPROB = -99999.0

_DTYPE_TO_NUMPY = {pb.DTYPE_FLOAT32: np.dtype("<f4"), pb.DTYPE_INT64: np.dtype("<i8")}
_DTYPE_TO_PUBLIC = {pb.DTYPE_FLOAT32: "float32", pb.DTYPE_INT64: "int64"}
_PUBLIC_TO_DTYPE = {"float32": pb.DTYPE_FLOAT32, "int64": pb.DTYPE_INT64}
_STOP_REASON_TO_PROTO = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


# Values all sparse tensors of one request may densify to, when the caller sets no limit
# (the server passes its body limit: as many values as a body may have bytes).
DEFAULT_MAX_DENSE_VALUES = 64 * 1024 * 1024


class WireError(ValueError):
    """A request body that cannot be decoded (-> HTTP 400 with a JSON body)."""


class DecodedForwardBackward(NamedTuple):
    """A decoded `/api/v1/forward_backward` body: the service's request, and how many
    loss_fn_inputs arrived as sparse CSR (densified here; the request log counts them)."""

    request: ForwardBackwardRequest
    sparse_inputs: int


# ---------------------------------------------------------------------------------------
# Requests: protobuf -> tinker types
# ---------------------------------------------------------------------------------------


def decompress_body(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """Undo `Content-Encoding: zstd` (the only request compression the SDK uses)."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding != "zstd":
        raise WireError(f"Content-Encoding: expected 'zstd' or none, got {content_encoding!r}")
    import zstandard

    try:
        reader = zstandard.ZstdDecompressor().stream_reader(body)
        out = reader.read(max_bytes + 1)
    except zstandard.ZstdError as exc:
        raise WireError(f"body: invalid zstd stream ({exc})") from exc
    if len(out) > max_bytes:
        raise WireError(f"body: decompressed size exceeds the limit of {max_bytes} bytes")
    return out


def decode_forward_backward_request(
    body: bytes, max_dense_values: int = DEFAULT_MAX_DENSE_VALUES, max_dense_bytes: int | None = None,
    max_fields: int | None = None,
) -> DecodedForwardBackward:
    """Parse a protobuf `ForwardBackwardRequest`; dense tensors, merged loss config.

    `max_dense_values` and `max_dense_bytes` (the server passes its body limit: a request
    may densify to no more than it could have sent densely) bound what the sparse CSR
    tensors of the request densify to, all together: their dense shape comes from the
    request, not from its bytes. The vocabulary bounds each one's columns later
    (`ember.losses.validation`), once the run's model is known. `max_fields` bounds the
    fields of the message at every level before it is parsed (`_check_field_count`).
    """
    if max_fields is not None:
        _check_field_count(body, max_fields)
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # google.protobuf.message.DecodeError and friends
        raise WireError(f"body: not a valid tinker_public.ForwardBackwardRequest protobuf ({exc})") from exc
    if not msg.model_id:
        raise WireError("model_id: expected a non-empty string, got ''")
    _check_sparse_budget(msg, max_dense_values, max_dense_bytes)
    data = [_decode_datum(i, d) for i, d in enumerate(msg.data)]
    request = ForwardBackwardRequest(msg.model_id, int(msg.seq_id), data, msg.loss_fn, merge_loss_config(msg),
                                     forward_only=bool(msg.forward_only))
    sparse = sum(t.HasField("sparse_csr") for d in msg.data for t in d.loss_fn_inputs.values())
    return DecodedForwardBackward(request, sparse)


def _check_field_count(body: bytes, max_fields: int) -> None:
    """Count the body's fields (tags) at every level, following the schema into
    sub-messages, and refuse more than `max_fields` before `ParseFromString` runs: the
    parser holds the interpreter lock, and 47 MB of two-byte fields kept every other
    request waiting for seconds. Plain Python (the lock is shared) stopping at the bound;
    malformed bytes stop the count and are left to the parser to name."""
    if len(body) < 2 * max_fields:
        return  # every field takes two bytes or more
    count = 0
    # Depth-first, one frame per open sub-message (freed when it ends): a scan that kept a
    # frame for each of 100k sub-messages set off full garbage collections, which hold the lock.
    stack = [[pb.ForwardBackwardRequest.DESCRIPTOR, 0, len(body)]]
    while stack:
        frame = stack[-1]
        desc, pos, end = frame
        if pos >= end:
            stack.pop()
            continue
        tag, pos = _varint(body, pos)
        kind = tag & 7
        if tag >> 3 == 0 or kind not in (0, 1, 2, 5):
            return  # malformed: the parser names it
        count += 1
        if count > max_fields:
            raise WireError(f"body: the protobuf message has more than {max_fields} fields; the limit is "
                            f"max_protobuf_fields={max_fields}")
        if kind == 0:
            pos = _varint(body, pos)[1]
        elif kind != 2:
            pos += 8 if kind == 1 else 4
        else:
            size, pos = _varint(body, pos)
            field = desc.fields_by_number.get(tag >> 3)
            frame[1] = pos + size
            if size and field is not None and field.message_type is not None:
                stack.append([field.message_type, pos, min(pos + size, end)])
            continue
        frame[1] = pos


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """A protobuf varint at `pos`: (value, next position); past the end reads as 0."""
    value = shift = 0
    while pos < len(buf) and shift < 64:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    return value, len(buf) + 1


def _check_sparse_budget(msg: pb.ForwardBackwardRequest, max_values: int, max_bytes: int | None) -> None:
    """Refuse sparse tensors whose dense form is too big *before* allocating it (a 20-byte
    tensor can claim shape [1, 2**40]); counted in values and in bytes (an int64 value is
    8 bytes: a values-only bound let 64M of them, 512 MB, through a 64 MB body limit)."""
    values = nbytes = 0
    for i, datum in enumerate(msg.data):
        for name, tensor in datum.loss_fn_inputs.items():
            if not tensor.HasField("sparse_csr"):
                continue
            count = math.prod(max(int(s), 0) for s in tensor.shape)
            values += count
            nbytes += count * _DTYPE_TO_NUMPY.get(tensor.dtype, np.dtype("<i8")).itemsize
            if values > max_values or (max_bytes is not None and nbytes > max_bytes):
                bound = (f"{values} values; the limit is {max_values}" if values > max_values
                         else f"{nbytes} bytes; the limit is {max_bytes} (the body limit)")
                raise WireError(
                    f"datum {i}: loss_fn_inputs[{name!r}]: sparse CSR shape {list(tensor.shape)} brings the "
                    f"request's densified sparse tensors to {bound}")


def merge_loss_config(msg: pb.ForwardBackwardRequest) -> dict[str, float | str]:
    """`loss_fn_config_v2` wins where present; the legacy float map fills the rest."""
    merged: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        which = value.WhichOneof("value")
        if which == "number":
            merged[key] = float(value.number)
        elif which == "text":
            merged[key] = value.text
        else:
            raise WireError(f"loss_fn_config_v2[{key!r}]: expected a number or text value, got neither")
    return merged


def _decode_datum(index: int, msg: pb.Datum) -> types.Datum:
    try:
        return _datum(index, msg)
    except WireError:
        raise
    except ValueError as exc:  # the SDK's own validation of what was decoded (pydantic, numpy)
        raise WireError(f"datum {index}: {exc}") from exc


def _datum(index: int, msg: pb.Datum) -> types.Datum:
    chunks = [_decode_chunk(index, j, c) for j, c in enumerate(msg.model_input)]
    inputs = {name: decode_tensor(t, where=f"datum {index}: loss_fn_inputs[{name!r}]")
              for name, t in msg.loss_fn_inputs.items()}
    model_spans = [_decode_span(index, "model_input_spans", s) for s in msg.model_input_spans]
    loss_spans = [_decode_span(index, "loss_fn_input_spans", s) for s in msg.loss_fn_input_spans]
    if bool(model_spans) != bool(loss_spans):
        raise WireError(f"datum {index}: model_input_spans and loss_fn_input_spans come as a pair")
    return types.Datum(
        model_input=types.ModelInput(chunks=chunks),
        loss_fn_inputs=inputs,
        model_input_spans=model_spans or None,
        loss_fn_input_spans=loss_spans or None,
    )


def _decode_chunk(index: int, j: int, msg: pb.Chunk) -> Any:
    where = f"datum {index}: model_input chunk {j}"
    try:
        return _chunk(where, msg)
    except WireError:
        raise
    except ValueError as exc:  # the SDK types validate their payload (e.g. a dmel TensorContainer)
        raise WireError(f"{where}: {msg.WhichOneof('chunk')}: {exc}") from exc


def _chunk(where: str, msg: pb.Chunk) -> Any:
    kind = msg.WhichOneof("chunk")
    if kind == "encoded_text":
        return types.EncodedTextChunk(tokens=decode_int32_tokens(msg.encoded_text.tokens, where=where))
    if kind == "image":
        fmt = msg.image.format
        if fmt not in ("png", "jpeg"):
            raise WireError(f"{where}: image format expected 'png' or 'jpeg', got {fmt!r}")
        expected = msg.image.expected_tokens if msg.image.HasField("expected_tokens") else None
        return types.ImageChunk(data=msg.image.data, format=fmt, expected_tokens=expected)
    if kind == "dmel":
        chunk = types.DmelChunk(dmel=msg.dmel.dmel)
        _ = chunk.length  # parses the TensorContainer now: a bad one is the client's 400, not a 500 later
        return chunk
    raise WireError(f"{where}: expected one of encoded_text/image/dmel, got an empty chunk")


def _decode_span(index: int, field: str, msg: pb.ProvenanceSpan) -> Any:
    kind = msg.WhichOneof("span")
    if kind is None:
        raise WireError(f"datum {index}: {field}: empty provenance span")
    arm = getattr(msg, kind)
    cls = types.PromptProvenanceSpan if kind == "prompt_tokens" else types.SampledProvenanceSpan
    try:
        return cls(sequence_id=arm.sequence_id, offset=int(arm.offset), length=int(arm.length))
    except ValueError as exc:
        raise WireError(f"datum {index}: {field}: {exc}") from exc


def decode_int32_tokens(raw: bytes, *, where: str = "tokens") -> list[int]:
    """Little-endian int32 token ids (the SDK's `encoded_text.tokens`)."""
    if len(raw) % 4:
        raise WireError(f"{where}: token bytes must be a multiple of 4 (int32), got {len(raw)} bytes")
    tokens = np.frombuffer(raw, dtype="<i4")
    if tokens.size and int(tokens.min()) < 0:
        raise WireError(f"{where}: token ids must be >= 0, got {int(tokens.min())}")
    return tokens.astype(np.int64).tolist()


def decode_tensor(msg: pb.Tensor, *, where: str) -> types.TensorData:
    """Dense `TensorData` (float32 or int64) from a proto `Tensor`, dense or sparse CSR."""
    np_dtype = _DTYPE_TO_NUMPY.get(msg.dtype)
    if np_dtype is None:
        got = pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else str(msg.dtype)
        raise WireError(f"{where}: dtype expected DTYPE_FLOAT32 or DTYPE_INT64, got {got}")
    shape = [int(s) for s in msg.shape]
    if any(s < 0 for s in shape):
        raise WireError(f"{where}: shape entries must be >= 0, got {shape}")
    kind = msg.WhichOneof("encoding")
    if kind == "sparse_csr":
        arr = _densify_csr(msg.sparse_csr, np_dtype, shape, where)
    else:
        arr = _frombuffer(msg.dense if kind == "dense" else b"", np_dtype, where, "dense")
        if shape:
            if math.prod(shape) != arr.size:
                raise WireError(f"{where}: shape {shape} needs {math.prod(shape)} values, got {arr.size}")
            arr = arr.reshape(shape)
        else:
            shape = [arr.size]
    if np_dtype.kind == "f" and not np.all(np.isfinite(arr)):
        raise WireError(f"{where}: values must be finite, got NaN or inf")
    return types.TensorData(data=arr.copy(), dtype=_DTYPE_TO_PUBLIC[msg.dtype], shape=shape)


def _frombuffer(raw: bytes, np_dtype: np.dtype, where: str, part: str) -> np.ndarray:
    if len(raw) % np_dtype.itemsize:
        raise WireError(
            f"{where}: {part} bytes must be a multiple of {np_dtype.itemsize} ({np_dtype.name}), "
            f"got {len(raw)} bytes"
        )
    return np.frombuffer(raw, dtype=np_dtype)


def _densify_csr(csr: pb.SparseCsr, np_dtype: np.dtype, shape: list[int], where: str) -> np.ndarray:
    if len(shape) != 2:
        raise WireError(f"{where}: sparse CSR needs a 2-D shape, got {shape}")
    rows, cols = shape
    values = _frombuffer(csr.values, np_dtype, where, "sparse_csr.values")
    crow = _frombuffer(csr.crow_indices, np.dtype("<i8"), where, "sparse_csr.crow_indices")
    col = _frombuffer(csr.col_indices, np.dtype("<i8"), where, "sparse_csr.col_indices")
    if crow.size != rows + 1:
        raise WireError(f"{where}: sparse_csr.crow_indices needs {rows + 1} entries, got {crow.size}")
    if crow[0] != 0 or np.any(np.diff(crow) < 0) or crow[-1] != values.size:
        raise WireError(f"{where}: sparse_csr.crow_indices must rise from 0 to nnz={values.size}")
    if col.size != values.size:
        raise WireError(f"{where}: sparse_csr.col_indices needs {values.size} entries, got {col.size}")
    if col.size and (int(col.min()) < 0 or int(col.max()) >= cols):
        raise WireError(f"{where}: sparse_csr.col_indices must lie in [0, {cols}), got {col.min()}..{col.max()}")
    dense = np.zeros((rows, cols), dtype=np_dtype)
    row_of_value = np.repeat(np.arange(rows), np.diff(crow))
    dense[row_of_value, col] = values
    return dense


# ---------------------------------------------------------------------------------------
# Results: tinker types -> protobuf
# ---------------------------------------------------------------------------------------


def encode_tensor(td: types.TensorData) -> pb.Tensor:
    """Proto `Tensor` (float32 or int64) from a `TensorData`: a sparse CSR one stays sparse
    (values in its dtype, row offsets and columns as int64, as the SDK's codec reads them)."""
    dtype = _PUBLIC_TO_DTYPE[td.dtype]
    np_dtype = _DTYPE_TO_NUMPY[dtype]
    if td.sparse_crow_indices is not None:
        values = np.ascontiguousarray(np.asarray(td.data), dtype=np_dtype)
        csr = pb.SparseCsr(values=values.tobytes(),
                           crow_indices=np.asarray(td.sparse_crow_indices, dtype="<i8").tobytes(),
                           col_indices=np.asarray(td.sparse_col_indices or [], dtype="<i8").tobytes())
        return pb.Tensor(sparse_csr=csr, dtype=dtype, shape=list(td.shape or []))
    arr = np.ascontiguousarray(td.to_numpy(), dtype=np_dtype)
    return pb.Tensor(dense=arr.tobytes(), dtype=dtype, shape=list(arr.shape))


def encode_forward_backward_output(out: types.ForwardBackwardOutput) -> bytes:
    """Protobuf `ForwardBackwardOutput`; one ArrayRecord per run of same-shaped datums."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type or "ArrayRecord")
    for key, value in out.metrics.items():
        msg.metrics[key] = float(value)
    arrays = [{name: np.asarray(td.to_numpy()) for name, td in datum.items()} for datum in out.loss_fn_outputs]
    for start, stop in _same_layout_runs(arrays):
        msg.loss_fn_outputs.append(_array_record(arrays[start:stop]))
    return msg.SerializeToString()


def _layout(datum: Mapping[str, np.ndarray]) -> tuple:
    return tuple(sorted((name, arr.dtype.kind, arr.shape[1:]) for name, arr in datum.items()))


def _same_layout_runs(arrays: Sequence[Mapping[str, np.ndarray]]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(arrays) + 1):
        if i == len(arrays) or _layout(arrays[i]) != _layout(arrays[start]):
            runs.append((start, i))
            start = i
    return runs


def _array_record(datums: Sequence[Mapping[str, np.ndarray]]) -> pb.ArrayRecord:
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(datums))
    for name in datums[0]:
        parts = [np.atleast_1d(d[name]) for d in datums]
        is_float = parts[0].dtype.kind == "f"
        np_dtype = np.dtype("<f4") if is_float else np.dtype("<i8")
        blobs = [np.ascontiguousarray(p, dtype=np_dtype).tobytes() for p in parts]
        offsets = np.concatenate([[0], np.cumsum([len(b) for b in blobs])]).astype("<i8")
        record.fields[name].CopyFrom(
            pb.BatchedTensor(
                data=b"".join(blobs),
                offsets=offsets.tobytes(),
                dtype=pb.DTYPE_FLOAT32 if is_float else pb.DTYPE_INT64,
                trailing_shape=list(parts[0].shape[1:]),
            )
        )
    return record


def encode_sample_response(resp: types.SampleResponse) -> bytes:
    """Protobuf `SampleResponse` (sequence ids are stamped by the client, not sent)."""
    msg = pb.SampleResponse(prompt_cache_hit_tokens=int(resp.prompt_cache_hit_tokens or 0))
    for seq in resp.sequences:
        msg.sequences.append(_encode_sequence(seq))
    if resp.prompt_logprobs is not None:
        values = [math.nan if v is None else float(v) for v in resp.prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    topk_prompt = _topk_rows(resp.topk_prompt_logprobs_np, resp.topk_prompt_logprobs)
    if topk_prompt is not None:
        msg.topk_prompt_logprobs.CopyFrom(topk_prompt)
    if resp.target_prompt_logprobs is not None:
        msg.target_prompt_logprobs.CopyFrom(encode_tensor(resp.target_prompt_logprobs))
    if resp.prompt_alt_tokens is not None:
        msg.prompt_alt_tokens.tokens.CopyFrom(encode_tensor(resp.prompt_alt_tokens.tokens))
        msg.prompt_alt_tokens.logprobs.CopyFrom(encode_tensor(resp.prompt_alt_tokens.logprobs))
    return msg.SerializeToString()


def _encode_sequence(seq: types.SampledSequence) -> pb.SampledSequence:
    if seq.stop_reason not in _STOP_REASON_TO_PROTO:
        raise ValueError(f"stop_reason: expected 'stop' or 'length', got {seq.stop_reason!r}")
    out = pb.SampledSequence(
        stop_reason=_STOP_REASON_TO_PROTO[seq.stop_reason],
        tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
    )
    if seq.logprobs is not None:
        out.logprobs = np.asarray(seq.logprobs, dtype="<f4").tobytes()
    topk = _topk_rows(seq.topk_logprobs_np, seq.topk_logprobs)
    if topk is not None:
        out.topk_sampled_logprobs.CopyFrom(topk)
    return out


def _topk_rows(
    dense: TopkLogprobs | None, rows: Sequence[Sequence[tuple[int, float]] | None] | None
) -> pb.TopkLogprobs | None:
    """Dense N x K matrices, empty cells and `None` rows filled with the sentinel."""
    if dense is not None:
        ids, lps = np.asarray(dense.token_ids, dtype="<i4"), np.asarray(dense.logprobs, dtype="<f4")
    elif rows is not None:
        k = max((len(r) for r in rows if r), default=0)
        ids = np.full((len(rows), k), TOPK_SENTINEL_TOKEN, dtype="<i4")
        lps = np.full((len(rows), k), TOPK_SENTINEL_LOGPROB, dtype="<f4")
        for i, row in enumerate(rows):
            for j, (tok, lp) in enumerate(row or ()):
                ids[i, j], lps[i, j] = tok, lp
    else:
        return None
    if ids.ndim != 2 or ids.shape != lps.shape:
        raise ValueError(f"top-k logprobs: expected two equal (N, K) matrices, got {ids.shape} and {lps.shape}")
    return pb.TopkLogprobs(
        token_ids=np.ascontiguousarray(ids).tobytes(),
        logprobs=np.ascontiguousarray(lps).tobytes(),
        k=ids.shape[1],
        length=ids.shape[0],
    )


# ---------------------------------------------------------------------------------------
# JSON results (everything except ForwardBackward/Forward/Sample, and old JSON-only SDKs)
# ---------------------------------------------------------------------------------------


def sanitize_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    return {metric_key(str(k)): float(v) for k, v in metrics.items()}


def to_json(value: Any) -> Any:
    """JSON-able form of a result: pydantic models with `exclude_none`, SDK dataclasses."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json", exclude_none=True)
    if isinstance(value, types.SampleResponse):
        return {
            "sequences": [
                {"stop_reason": s.stop_reason, "tokens": list(s.tokens), "logprobs": s.logprobs,
                 "topk_logprobs": s.topk_logprobs}
                for s in value.sequences
            ],
            "prompt_logprobs": value.prompt_logprobs,
            "topk_prompt_logprobs": value.topk_prompt_logprobs,
            "prompt_cache_hit_tokens": int(value.prompt_cache_hit_tokens or 0),
            **_prompt_extras_json(value),
            "type": "sample",
        }
    if isinstance(value, types.TensorData) and value.sparse_crow_indices is not None:
        return {"data": value.data, "dtype": value.dtype, "shape": list(value.shape or []),  # never densified
                "sparse_crow_indices": list(value.sparse_crow_indices),
                "sparse_col_indices": list(value.sparse_col_indices or [])}
    if isinstance(value, types.TensorData):
        return {"data": value.to_numpy().ravel().tolist(), "dtype": value.dtype,
                "shape": list(value.to_numpy().shape)}
    if isinstance(value, types.ForwardBackwardOutput):
        return {
            "loss_fn_output_type": value.loss_fn_output_type,
            "loss_fn_outputs": [{k: to_json(v) for k, v in d.items()} for d in value.loss_fn_outputs],
            "metrics": {k: float(v) for k, v in value.metrics.items()},
        }
    if isinstance(value, Mapping):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


def _prompt_extras_json(value: types.SampleResponse) -> dict:
    out: dict[str, Any] = {}
    if value.target_prompt_logprobs is not None:
        out["target_prompt_logprobs"] = to_json(value.target_prompt_logprobs)
    if value.prompt_alt_tokens is not None:
        out["prompt_alt_tokens"] = {"tokens": to_json(value.prompt_alt_tokens.tokens),
                                    "logprobs": to_json(value.prompt_alt_tokens.logprobs)}
    return out


def json_safe(value: Any) -> Any:
    """`value` with every NaN and infinity replaced by null. JSON has neither, and the SDK
    parses JSON with orjson, which refuses them: a forward whose loss overflowed must still
    answer (the protobuf results carry non-finite floats as they are)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
