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


# Ids and times the service keeps as 64-bit database integers: a bigger JSON number
# (Python reads any size) reached SQLite as an OverflowError, a 500.
_INT64_FIELDS = ("seq_id", "model_seq_id", "sampling_session_seq_id", "ttl_seconds")


def _check_int64_fields(data: dict[str, Any]) -> None:
    for name in _INT64_FIELDS:
        value = data.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
            raise BadRequest(f"{name}: expected a 64-bit integer, got {value}")


CreateSessionRequest = types.CreateSessionRequest
SessionHeartbeatRequest = types.SessionHeartbeatRequest
CreateModelRequest = types.CreateModelRequest
GetInfoRequest = types.GetInfoRequest
OptimStepRequest = types.OptimStepRequest

# Non-Adam params families by `type`. The SDK's union would read a Dimuon body as AdamParams
# once unknown fields are ignored, so the family is chosen from the raw `type` first.
class DimuonWireParams(types.DimuonParams):
    """SDK 0.38's DimuonParams plus the two fields Tinker's docs list and that SDK lacks:
    taken from a newer SDK's request instead of being dropped (None = ember's default)."""

    damping: float | None = None
    rank_lr_correction_exponent: float | None = None


OPTIM_PARAMS: dict[str, type[pydantic.BaseModel]] = {"adamw": types.AdamParams, "dimuon": DimuonWireParams}


def optim_params(data: Any, parsed: types.OptimStepRequest):
    """The request's optimizer params as their own type (AdamParams, DimuonParams)."""
    raw = next((data[k] for k in ("optimizer_params", "optim_params", "adam_params") if k in data), None)
    kind = raw.get("type", "adamw") if isinstance(raw, dict) else "adamw"
    if kind == "adamw":
        return parsed.optim_params
    if kind not in OPTIM_PARAMS:
        raise BadRequest(f"optimizer_params.type: unknown optimizer {kind!r}; known: {', '.join(OPTIM_PARAMS)}")
    return OPTIM_PARAMS[kind].model_validate(raw, extra="ignore")
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
