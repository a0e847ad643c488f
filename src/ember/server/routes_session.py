"""Client configuration, sessions, heartbeats, telemetry (docs/protocol.md §1.4-1.6)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from ember.server import requests as rq
from ember.server.deps import Limit, Offset, Owner, ServiceDep, get_config, log_extra, model_response, read_json
from ember.server.errors import BadRequest
from ember.service import requests as sr

router = APIRouter()


@router.post("/client/config")
async def client_config(request: Request, owner: str = Owner):
    await rq.read(request, rq.ClientConfigRequest)
    return JSONResponse(dict(get_config(request).client_config))


@router.post("/client/dynamic_config")
async def dynamic_config(request: Request, owner: str = Owner):
    await rq.read(request, rq.ClientConfigRequest)
    return JSONResponse(dict(get_config(request).dynamic_config))


@router.post("/create_session")
async def create_session(request: Request, owner: str = Owner, service=ServiceDep):
    req = await rq.read(request, rq.CreateSessionRequest)
    resp = await run_in_threadpool(service.open_session, owner, sr.CreateSessionRequest(
        tags=list(req.tags), user_metadata=req.user_metadata or {}, project_id=req.project_id,
        display_name=req.display_name, sdk_version=req.sdk_version))
    log_extra(request, session_id=resp.session_id)
    return model_response(resp)


@router.post("/session_heartbeat")
async def session_heartbeat(request: Request, owner: str = Owner, service=ServiceDep):
    req = await rq.read(request, rq.SessionHeartbeatRequest)
    await run_in_threadpool(service.heartbeat, owner, req.session_id)
    return JSONResponse({"type": "session_heartbeat"})


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request, owner: str = Owner, service=ServiceDep):
    req = await rq.read(request, rq.FinishSessionRequest)
    await run_in_threadpool(service.finish_session, owner, session_id, req.reason.type, req.detail)
    return JSONResponse({})


@router.post("/telemetry")
async def telemetry(request: Request, owner: str = Owner):
    # Accepted and dropped: a self-hosted server has nowhere to send it.
    req = await rq.read(request, rq.TelemetryRequest)
    # names only, a few: the log line is written on the event loop
    log_extra(request, events=[str(e.get("event"))[:64] for e in req.events[:32]])
    return JSONResponse({"status": "accepted"})


@router.get("/sessions")
async def list_sessions(limit: int = Limit, offset: int = Offset, owner: str = Owner, service=ServiceDep):
    return model_response(await run_in_threadpool(service.list_sessions, owner, limit, offset))


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, owner: str = Owner, service=ServiceDep):
    return model_response(await run_in_threadpool(service.get_session, owner, session_id))


MAX_ID_CHARS = 256  # session and sequence ids the server makes are far shorter


@router.get("/sessions/{session_id}/sequences/{sequence_id}")
async def sequence_provenance(session_id: str, sequence_id: str, owner: str = Owner, service=ServiceDep):
    """ember's own: the provenance of one sampled sequence (`ServiceAPI.sequence_provenance`):
    which in-flight weights drew which of its tokens (README "In-flight weights")."""
    for name, value in (("session_id", session_id), ("sequence_id", sequence_id)):
        if len(value) > MAX_ID_CHARS:
            raise BadRequest(f"{name}: expected at most {MAX_ID_CHARS} characters, got {len(value)}")
    return model_response(await run_in_threadpool(service.sequence_provenance, owner, session_id, sequence_id))


@router.get("/healthz")
async def healthz():
    return JSONResponse({"status": "ok"})
