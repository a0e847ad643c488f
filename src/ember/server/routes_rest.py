"""RestClient endpoints: training runs, checkpoints, weights info, capabilities (§2.5).

`access_scope` ("owned" | "accessible") is accepted; both mean the caller's own runs:
what one API key shares with others is a published checkpoint, read by its tinker path
(sampling, loading, weights info), never a listing, or one private checkpoint's training
state through a weights access token its owner makes here (`.../access_token`). `project_id` filtering is not
supported (the parameter is accepted and ignored).
"""

from __future__ import annotations

from datetime import datetime, timezone

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from ember.server import requests as rq
from ember.server.errors import BadRequest
from ember.server.deps import Limit, Offset, Owner, ServiceDep, model_response, read_json

router = APIRouter()


@router.get("/get_server_capabilities")
async def get_server_capabilities(owner: str = Owner, service=ServiceDep):
    return model_response(await run_in_threadpool(service.get_server_capabilities))


@router.get("/training_runs")
async def list_training_runs(limit: int = Limit, offset: int = Offset, owner: str = Owner, service=ServiceDep):
    return model_response(await run_in_threadpool(service.list_training_runs, owner, limit, offset))


@router.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, owner: str = Owner, service=ServiceDep):
    return model_response(await run_in_threadpool(service.get_training_run, owner, run_id))


@router.get("/training_runs/{run_id}/metrics")
async def metric_history(run_id: str, owner: str = Owner, service=ServiceDep):
    """ember's own: the run's per-step metrics (`ember.service.metric_history`), the console's curves."""
    return model_response(await run_in_threadpool(service.metric_history_of, owner, run_id))


@router.get("/training_runs/{run_id}/checkpoints")
async def list_checkpoints(run_id: str, owner: str = Owner, service=ServiceDep):
    return model_response(await run_in_threadpool(service.list_checkpoints, owner, run_id))


# Before DELETE .../checkpoints/{checkpoint_id:path}, which would read "<id>/publish" as an id.
@router.post("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
async def publish_checkpoint(run_id: str, checkpoint_id: str, owner: str = Owner, service=ServiceDep):
    await run_in_threadpool(service.set_checkpoint_public, owner, run_id, checkpoint_id, True)
    return JSONResponse({})


@router.post("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/access_token")
async def create_weights_access_token(run_id: str, checkpoint_id: str, request: Request, owner: str = Owner,
                                      service=ServiceDep):
    """ember's own: a `weights_access_token` that lets another API key load this private
    `weights/<name>` checkpoint (`load_state`, `create_training_client_from_state`)."""
    req = await rq.read(request, rq.WeightsAccessTokenRequest)
    token, expires = await run_in_threadpool(service.create_weights_access_token, owner, run_id, checkpoint_id,
                                             req.ttl_seconds)
    return JSONResponse({"weights_access_token": token,
                         "expires": datetime.fromtimestamp(expires, tz=timezone.utc).isoformat()})


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
async def unpublish_checkpoint(run_id: str, checkpoint_id: str, owner: str = Owner, service=ServiceDep):
    await run_in_threadpool(service.set_checkpoint_public, owner, run_id, checkpoint_id, False)
    return JSONResponse({})


@router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl")
async def set_checkpoint_ttl(run_id: str, checkpoint_id: str, request: Request, owner: str = Owner, service=ServiceDep):
    body = await read_json(request)
    if not isinstance(body, dict) or "ttl_seconds" not in body:
        raise BadRequest(f"body: expected {{\"ttl_seconds\": <integer seconds or null>}}, got {body!r:.100}")
    await run_in_threadpool(service.set_checkpoint_ttl, owner, run_id, checkpoint_id, body["ttl_seconds"])
    return JSONResponse({})


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(run_id: str, checkpoint_id: str, owner: str = Owner, service=ServiceDep):
    await run_in_threadpool(service.delete_checkpoint, owner, run_id, checkpoint_id)
    return JSONResponse({})


@router.get("/checkpoints")
async def list_user_checkpoints(limit: int = Query(100, ge=1, le=10000), offset: int = Offset,
                                owner: str = Owner, service=ServiceDep):
    return model_response(await run_in_threadpool(service.list_user_checkpoints, owner, limit, offset))


@router.post("/weights_info")
async def weights_info(request: Request, owner: str = Owner, service=ServiceDep):
    req = await rq.read(request, rq.WeightsInfoRequest)
    return model_response(await run_in_threadpool(service.get_weights_info, owner, req.tinker_path))
