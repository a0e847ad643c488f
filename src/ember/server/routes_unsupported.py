"""SDK endpoints ember does not implement: 404 with the reason (`ember.service.unsupported`).

The SDK makes `tinker.NotFoundError("Error code: 404 - {body}")` of this answer, which is
exactly what the in-process client raises for the same method.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from ember.service.unsupported import unsupported_body
from ember.server.deps import Owner

router = APIRouter()

# (HTTP method, SDK path under /api/v1, SDK method)
ENDPOINTS = [
    ("PUT", "/sessions/{session_id}/project", "assign_session_project"),
    ("GET", "/sessions/{session_id}/trace_export", "export_session_trace"),
    ("POST", "/sessions/search", "search_sessions"),
]


def _answer(method: str):
    async def endpoint(owner: str = Owner):  # only callers with a key learn what is missing
        return JSONResponse(unsupported_body(method), status_code=404)

    endpoint.__name__ = f"unsupported_{method}"
    return endpoint


for _verb, _path, _method in ENDPOINTS:
    router.add_api_route(_path, _answer(_method), methods=[_verb])
