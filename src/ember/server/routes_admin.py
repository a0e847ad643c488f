"""The operator's routes, under `/api/v1/admin/` (README "Operating ember"; `ember admin`).

Only `--admin-api-key` is accepted here: any other accepted key gets 403 with the reason,
a missing or unknown one 401, as everywhere. These routes see every key's sessions, runs
and checkpoints (`ServiceAPI.operator_*`, no owner check); the ordinary routes keep their
owner checks for every key, the operator's included (it is its own tenant there).

    GET  /api/v1/admin/overview                        sessions, runs, checkpoints, usage per key
    POST /api/v1/admin/sessions/{session_id}/end       end a session (its runs saved, unloaded)
    POST /api/v1/admin/training_runs/{run_id}/unload   unload a run (saved first)
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ember.server.config import ServerConfig, presented_key
from ember.server.deps import ServiceDep
from ember.server.errors import AuthError

# Out of the OpenAPI document, which lists the SDK's API (the fuzz tests generate requests
# from it); these take no body, and any key but the operator's gets 403.
router = APIRouter(prefix="/admin", include_in_schema=False)


def require_admin(request: Request) -> None:
    """401 for no or an unknown key; 403, saying why, for any key but `--admin-api-key`."""
    config: ServerConfig = request.app.state.config
    key = presented_key(request.headers)
    if config.is_admin_key(key):
        return
    if config.owner_for(key) is None:
        raise AuthError("missing API key (X-API-Key or Authorization: Bearer header)" if not key
                        else "invalid API key")
    reason = ("this server has no operator key (start it with --admin-api-key)" if not config.admin_api_key
              else "this API key is not the server's --admin-api-key")
    raise HTTPException(403, f"{request.url.path}: the admin routes take the operator's key only; {reason}")


Admin = Depends(require_admin)


def usage(request: Request, view: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per owner: the service's totals and the per-key counters of /metrics."""
    metrics = getattr(request.app.state, "metrics", None)
    counters = metrics.key_usage() if metrics is not None else {}
    key_id = metrics.key_id if metrics is not None else (lambda owner: "")
    rows = []
    for owner, totals in sorted(view["owners"].items()):
        kid = key_id(owner)
        rows.append({"key": kid, "owner": owner, **totals, **{k: int(v) for k, v in counters.get(kid, {}).items()}})
    return rows


@router.get("/overview", dependencies=[Admin])
async def overview(request: Request, service=ServiceDep) -> dict[str, Any]:
    config: ServerConfig = request.app.state.config
    view = await run_in_threadpool(service.operator_view, sorted(set(config.api_keys.values())))
    view["usage"] = usage(request, view)
    return view


@router.post("/sessions/{session_id}/end", dependencies=[Admin])
async def end_session(session_id: str, service=ServiceDep) -> dict[str, Any]:
    await run_in_threadpool(service.operator_end_session, session_id)
    return {"session_id": session_id, "status": "ended"}


@router.post("/training_runs/{run_id}/unload", dependencies=[Admin])
async def unload_run(run_id: str, service=ServiceDep) -> dict[str, Any]:
    saved = await run_in_threadpool(service.operator_unload_run, run_id)
    return {"run_id": run_id, "status": "unloaded", "saved_as": saved}
