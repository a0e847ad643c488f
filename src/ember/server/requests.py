"""JSON request bodies: the SDK's own pydantic request types, validated leniently.

The SDK's types forbid unknown fields (`StrictBase`), also in nested models (LoraConfig,
chunks, SamplingParams...). A server must accept and ignore fields it does not know
(docs/protocol.md §8 item 13), so `parse` validates with `extra="ignore"` (pydantic
>= 2.11 applies it to nested models too).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, TypeVar

import pydantic
from pydantic import ConfigDict
from tinker import types

from ember.server.errors import BadRequest
from ember.service.limits import INT64_FIELDS

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


class TelemetryRequest(pydantic.BaseModel):
    model_config = _LENIENT
    events: list[dict[str, Any]] = []
    session_id: Optional[str] = None
