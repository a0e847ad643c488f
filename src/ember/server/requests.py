"""JSON request bodies: the SDK's own pydantic request types, validated leniently.

The SDK's types forbid unknown fields (`StrictBase`), also in nested models (LoraConfig,
chunks, SamplingParams...). A server must accept and ignore fields it does not know
(docs/protocol.md §8 item 13), so `parse` validates with `extra="ignore"` (pydantic
>= 2.11 applies it to nested models too).

Bodies are decoded and validated off the event loop (`read`, `read_json`), and bounded
before they are parsed (`decode_json`): the parser holds the interpreter lock whichever
thread runs it, so a body may carry at most `Limits.max_json_values` values, and its
nesting (`Limits.max_json_depth`) and strings (no lone surrogates) are checked before any
route, database or tokenizer sees it (docs/architecture.md, "Trust boundaries").
"""

from __future__ import annotations

import json

import numpy as np
from typing import Any, Literal, Optional, TypeVar

import pydantic
from fastapi import Request
from pydantic import ConfigDict
from starlette.concurrency import run_in_threadpool
from tinker import types

from ember.server.errors import BadRequest
from ember.server.middleware import BodyTooLarge
from ember.service.api import UserError
from ember.service.limits import INT64_FIELDS, Limits, check_json_tree

_LENIENT = ConfigDict(extra="ignore", protected_namespaces=())

M = TypeVar("M", bound=pydantic.BaseModel)


def parse(model: type[M], data: Any) -> M:
    """Validate `data` as `model`, ignoring unknown fields at every level.

    Raises `BadRequest` (-> 400) for a non-object body and `pydantic.ValidationError`
    (-> 422 with the details) for one that does not fit the model.
    """
    if not isinstance(data, dict):
        raise BadRequest(f"body: expected a JSON object, got {type(data).__name__}")
    _check_int64_fields(data)
    return model.model_validate(data, extra="ignore")


def limits_of(request: Request) -> Limits:
    """The service's `Limits` (the defaults for a service that has none, e.g. a test's)."""
    limits = getattr(getattr(request.app.state.service, "config", None), "limits", None)
    return limits if isinstance(limits, Limits) else Limits()


def decode_json(raw: bytes, limits: Limits) -> Any:
    """A JSON body, bounded before and checked after parsing (pure; `BadRequest` -> 400).

    The value count is bounded from the bytes (every value but the first follows a comma
    or opens a container; brackets and commas inside strings only over-count)."""
    if not raw:
        return {}
    values = 1 + raw.count(b",") + raw.count(b"[") + raw.count(b"{")
    if values > limits.max_json_values:
        raise BadRequest(f"body: holds up to {values} JSON values; the limit is "
                         f"max_json_values={limits.max_json_values}")
    try:
        doc = json.loads(raw)
    except RecursionError:  # deeper than the parser goes (~1,000 levels): name the top-level field
        where = _deep_member(raw, limits.max_json_depth)
        raise BadRequest(f"{where}: nested deeper than {limits.max_json_depth} levels "
                         f"(max_json_depth={limits.max_json_depth})") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body: invalid JSON ({exc})") from exc
    try:
        check_json_tree(doc, limits.max_json_depth)
    except UserError as exc:
        raise BadRequest(str(exc)) from None
    return doc


def _deep_member(raw: bytes, max_depth: int) -> str:
    """`body.<key>` for the top-level member where `raw` first nests deeper than
    `max_depth` (`body` when the body is not an object). Brackets inside strings do not
    count: a quote is real when an even number of backslashes precedes it."""
    b = np.frombuffer(raw, dtype=np.uint8)
    idx = np.arange(b.size, dtype=np.int64)
    last_plain = np.maximum.accumulate(np.where(b != 0x5C, idx, -1))  # last non-backslash at or before i
    quote = b == 0x22
    run = idx - 1 - np.concatenate(([-1], last_plain[:-1]))  # backslashes right before i
    real = quote & (run % 2 == 0)
    inside = (np.cumsum(real) % 2 == 1) | real
    step = np.where(inside, 0, (b == 0x5B) | (b == 0x7B)).astype(np.int32) \
        - np.where(inside, 0, (b == 0x5D) | (b == 0x7D)).astype(np.int32)
    depth = np.cumsum(step, dtype=np.int32)
    over = np.flatnonzero(depth > max_depth)
    if not over.size or b[np.flatnonzero(b > 0x20)[:1]].tobytes() != b"{":
        return "body"
    quotes = np.flatnonzero(real[: over[0]])
    for end, start in zip(quotes[::-1][0::2], quotes[::-1][1::2]):  # strings before it, last first
        after = raw[end + 1: end + 64].lstrip()
        if depth[start] == 1 and after.startswith(b":"):
            try:
                return f"body.{json.loads(raw[start:end + 1])}"
            except ValueError:
                return "body"
    return "body"


async def read_body(request: Request, limits: Limits) -> bytes:
    """A JSON body, refused (413) past `max_json_body_bytes`: by its Content-Length before
    it is read, else as it streams in."""
    limit = limits.max_json_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit, "max_json_body_bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit, "max_json_body_bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request) -> Any:
    """The body as checked JSON (`decode_json`), decoded in the thread pool."""
    limits = limits_of(request)
    raw = await read_body(request, limits)
    return await run_in_threadpool(decode_json, raw, limits)


async def read(request: Request, model: type[M]) -> M:
    """The body as `model` (`read_json`, then `parse`), all of it off the event loop."""
    limits = limits_of(request)
    raw = await read_body(request, limits)
    return await run_in_threadpool(_decode_and_parse, raw, limits, model)


def _decode_and_parse(raw: bytes, limits: Limits, model: type[M]) -> M:
    return parse(model, decode_json(raw, limits))


def _check_int64_fields(data: dict[str, Any]) -> None:
    for name in INT64_FIELDS:
        value = data.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
            raise BadRequest(f"{name}: expected a 64-bit integer, got {value}")


CreateSessionRequest = types.CreateSessionRequest
SessionHeartbeatRequest = types.SessionHeartbeatRequest
CreateModelRequest = types.CreateModelRequest
GetInfoRequest = types.GetInfoRequest
OptimStepRequest = types.OptimStepRequest

def optim_params(data: Any, parsed: types.OptimStepRequest):
    """The request's optimizer params as their optimizer's wire type (`OPTIMIZERS` entry).
    The SDK's union would read a Dimuon body as AdamParams once unknown fields are
    ignored, so the family is chosen from the raw `type` first."""
    from ember.engine.optimizers import OPTIMIZERS

    raw = next((data[k] for k in ("optimizer_params", "optim_params", "adam_params") if k in data), None)
    if not isinstance(raw, dict):
        return parsed.optim_params
    kind = raw.get("type", "adamw")
    if kind not in OPTIMIZERS:
        raise BadRequest(f"optimizer_params.type: unknown optimizer {kind!r}; known: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[kind].wire_params.model_validate(raw, extra="ignore")


def optimizer_config(data: Any, parsed: Any) -> dict[str, Any] | None:
    """A create/load request's `optimizer_config` as sent (its family's own fields kept:
    the SDK's union keeps only `type` of a family it does not know); the service
    validates it against the optimizer's entry."""
    raw = data.get("optimizer_config") if isinstance(data, dict) else None
    if isinstance(raw, dict):
        return dict(raw)
    return parsed.optimizer_config.model_dump(mode="json") if parsed.optimizer_config is not None else None
SaveWeightsRequest = types.SaveWeightsRequest
LoadWeightsRequest = types.LoadWeightsRequest
SaveWeightsForSamplerRequest = types.SaveWeightsForSamplerRequest
SaveWeightsExternalRequest = types.SaveWeightsExternalRequest
CreateSamplingSessionRequest = types.CreateSamplingSessionRequest
SampleRequest = types.SampleRequest
FutureRetrieveRequest = types.FutureRetrieveRequest


class ClientConfigRequest(pydantic.BaseModel):
    model_config = _LENIENT
    sdk_version: Optional[str] = None


class FinishSessionReason(pydantic.BaseModel):
    model_config = _LENIENT
    type: Literal["success", "errored", "interrupted"] = "success"


class FinishSessionRequest(pydantic.BaseModel):
    model_config = _LENIENT
    reason: FinishSessionReason = FinishSessionReason()
    detail: Optional[str] = None


class WeightsInfoRequest(pydantic.BaseModel):
    model_config = _LENIENT
    tinker_path: str


class WeightsAccessTokenRequest(pydantic.BaseModel):
    """ember's own: `{"ttl_seconds": int | null}` (checked by the checkpoint store, which names it)."""
    model_config = _LENIENT
    ttl_seconds: Any = None


class TelemetryRequest(pydantic.BaseModel):
    model_config = _LENIENT
    events: list[dict[str, Any]] = []
    session_id: Optional[str] = None
