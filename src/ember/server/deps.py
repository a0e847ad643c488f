"""What every route shares: the caller's owner (API key), the service, body parsing,
request-log facts, and the two response shapes (futures and models)."""

from __future__ import annotations

from typing import Any

from fastapi import Depends, Query, Request
from fastapi.responses import JSONResponse

from ember.server.config import ServerConfig, presented_key
from ember.server.errors import AuthError, BadRequest
from ember.server.middleware import LOG_STATE_KEY
from ember.server.requests import read_json  # noqa: F401 (the routes' import; bounded, off the loop)
from ember.server.wire import json_safe, to_json
from ember.service.api import ServiceAPI, Submission
from ember.service.limits import MAX_OFFSET, MAX_PAGE_SIZE


def get_service(request: Request) -> ServiceAPI:
    return request.app.state.service


def get_config(request: Request) -> ServerConfig:
    return request.app.state.config


def get_owner(request: Request) -> str:
    """The API key's identity; 401 (JSON body) for a missing or unknown key."""
    key = presented_key(request.headers)
    owner = request.app.state.config.owner_for(key)
    if owner is None:
        raise AuthError("missing API key (X-API-Key or Authorization: Bearer header)" if not key
                        else "invalid API key")
    return owner


Owner = Depends(get_owner)
ServiceDep = Depends(get_service)  # not `Service`: that is the service class's name

# Listing pages, bounded by `ember.service.limits` (the offset bound keeps it inside the
# database's 64-bit integers; no listing is longer).
Limit = Query(20, ge=1, le=MAX_PAGE_SIZE)
Offset = Query(0, ge=0, le=MAX_OFFSET)


def log_extra(request: Request, **facts: Any) -> None:
    """Facts for the optional request log (decoded seq ids and the like)."""
    request.scope.setdefault("state", {}).setdefault(LOG_STATE_KEY, {}).update(facts)


def future_response(submission: Submission) -> JSONResponse:
    """The wire's UntypedAPIFuture: string ids only, `None` fields omitted."""
    body: dict[str, Any] = {"request_id": str(submission.request_id)}
    if submission.model_id is not None:
        body["model_id"] = str(submission.model_id)
    if submission.sample_sequence_ids is not None:
        body["sample_sequence_ids"] = [str(s) for s in submission.sample_sequence_ids]
    return JSONResponse(body)


class ResultResponse(JSONResponse):
    """JSON of a result; non-finite floats become null (see `wire.json_safe`), checked
    only when the strict encoder refuses the body."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except ValueError:
            return super().render(json_safe(content))


def model_response(model: Any) -> JSONResponse:
    return ResultResponse(to_json(model))
