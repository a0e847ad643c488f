"""SDK endpoints ember does not implement: 404 with the reason (`ember.service.unsupported`).

The SDK makes `tinker.NotFoundError("Error code: 404 - {body}")` of this answer, which is
exactly what the in-process client raises for the same method. Every path the SDK can call
is either served or listed here (tests/server/test_server_sdk_routes.py reads the SDK's
source for them), so none reaches the generic `{"error": "Not Found"}`.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from ember.service.unsupported import unsupported_body
from ember.server.deps import Owner

router = APIRouter()

# (HTTP method, SDK path under /api/v1, SDK method or route name)
ENDPOINTS = [
    ("PUT", "/sessions/{session_id}/project", "assign_session_project"),
    ("GET", "/sessions/{session_id}/trace_export", "export_session_trace"),
    ("POST", "/sessions/search", "search_sessions"),
    ("POST", "/copy_weights", "copy_weights"),
    ("GET", "/audit", "get_audit_log"),
    ("GET", "/billing/usage/events", "get_billing_usage"),
    ("GET", "/billing/usage/checkpoints/current", "get_current_checkpoint_storage_usage"),
    ("GET", "/auth/apikey/me", "get_self_api_key"),
    ("DELETE", "/auth/apikey/me", "delete_self_api_key"),
    ("POST", "/auth/token", "auth_token"),
    ("POST", "/join_sampling_session", "join_sampling_session"),
    ("POST", "/cancel_future", "cancel_future"),
    ("POST", "/retrieve_futures", "retrieve_futures"),
    ("POST", "/create_custom_loss", "create_custom_loss"),
]


def _answer(method: str):
    async def endpoint(owner: str = Owner):  # only callers with a key learn what is missing
        return JSONResponse(unsupported_body(method), status_code=404)

    endpoint.__name__ = f"unsupported_{method}"
    return endpoint


for _verb, _path, _method in ENDPOINTS:
    router.add_api_route(_path, _answer(_method), methods=[_verb])
