"""External-weights exports: `save_weights_external`, its download links and the files.

    POST /save_weights_external                         -> future(SaveWeightsExternalResponseInternal)
    GET  /training_runs/{run}/checkpoints/external_weights/{name}/external_weights_urls
                                                        -> {"urls": {file: url}, "expires": time}
    GET  /external_weights/{token}/{file}               -> the file (streamed from disk)

The file route takes no API key: the SDK's CLI downloads with plain urllib. The token in
the link is the authority (HMAC-signed, expiring, bound to the export and its owner; see
`ember.service.external`); anything else (forged, expired, deleted, another file) is 404.
"""

from __future__ import annotations

from datetime import datetime, timezone
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool
from tinker import types

from ember.server import requests as rq
from ember.server.deps import Owner, ServiceDep, future_response, log_extra, model_response, read_json
from ember.server.errors import BadRequest

router = APIRouter()
API_ROOT = "/api/v1"  # where `create_app` mounts this router


@router.post("/save_weights_external")
async def save_weights_external(request: Request, owner: str = Owner, service=ServiceDep):
    req = await rq.read(request, rq.SaveWeightsExternalRequest)
    if req.seq_id is None:
        raise BadRequest("seq_id: expected an integer >= 1, got none")
    log_extra(request, model_id=req.model_id, seq_id=req.seq_id)
    sub = await run_in_threadpool(
        service.save_weights_external, owner, req.model_id, req.seq_id, req.path, ttl_seconds=req.ttl_seconds,
        age_encryption_recipients=req.age_encryption_recipients,
    )
    return future_response(sub)


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
async def external_weights_urls(run_id: str, checkpoint_id: str, request: Request, owner: str = Owner,
                                service=ServiceDep):
    links = await run_in_threadpool(service.external_weights_links, owner, run_id, checkpoint_id)
    api_root = str(request.base_url).rstrip("/") + API_ROOT  # base_url holds any --path-prefix (root_path)
    return model_response(types.ExternalWeightsUrlsResponse(
        urls={f: f"{api_root}/external_weights/{links.token}/{quote(f)}" for f in links.files},
        expires=datetime.fromtimestamp(links.expires, tz=timezone.utc),
    ))


@router.get("/external_weights/{token}/{file:path}")
async def external_weights_file(token: str, file: str, service=ServiceDep):
    path = await run_in_threadpool(service.open_external_weights_file, token, file)
    return FileResponse(path, media_type="application/octet-stream")
