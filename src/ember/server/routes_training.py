"""Training runs: create_model, get_info, forward_backward (protobuf), optim_step,
save/load weights, save_weights_for_sampler (docs/protocol.md §2.2-2.3)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from ember.server import requests as rq
from ember.server import wire
from ember.server.deps import Owner, ServiceDep, future_response, get_config, log_extra, model_response, read_json
from ember.server.errors import BadRequest
from ember.service import requests as sr

router = APIRouter()


@router.post("/create_model")
async def create_model(request: Request, owner: str = Owner, service=ServiceDep):
    data = await rq.read_json(request)
    req = await run_in_threadpool(rq.parse, rq.CreateModelRequest, data)
    sub = await run_in_threadpool(service.submit, owner, sr.CreateModelRequest(
        req.session_id, req.model_seq_id, req.base_model, req.lora_config,
        optimizer_config=rq.optimizer_config(data, req), user_metadata=req.user_metadata))
    return future_response(sub)


@router.post("/get_info")
async def get_info(request: Request, owner: str = Owner, service=ServiceDep):
    req = await rq.read(request, rq.GetInfoRequest)
    return model_response(await run_in_threadpool(service.get_info, owner, req.model_id))


async def _decode_forward_backward(request: Request) -> wire.DecodedForwardBackward:
    content_type = request.headers.get("content-type", "")
    if "protobuf" not in content_type:
        raise BadRequest(
            f"Content-Type: expected {wire.PROTOBUF_CONTENT_TYPE} (tinker_public.ForwardBackwardRequest), "
            f"got {content_type or 'none'!r}"
        )
    body = await request.body()
    limit = get_config(request).max_body_bytes
    return await run_in_threadpool(_decode_protobuf, body, request.headers.get("content-encoding"), limit,
                                   rq.limits_of(request).max_protobuf_fields)


def _decode_protobuf(body: bytes, content_encoding: str | None, limit: int, max_fields: int) -> wire.DecodedForwardBackward:
    """Decompression and decoding, off the event loop; sparse tensors may densify to as many
    bytes as a body may have (`wire.decode_forward_backward_request`)."""
    raw = wire.decompress_body(body, content_encoding, max_bytes=limit)
    return wire.decode_forward_backward_request(raw, max_dense_bytes=limit, max_fields=max_fields)


@router.post("/forward_backward")
async def forward_backward(request: Request, owner: str = Owner, service=ServiceDep):
    call, sparse_inputs = await _decode_forward_backward(request)
    log_extra(request, model_id=call.model_id, seq_id=call.seq_id, loss_fn=call.loss_fn,
              forward_only=call.forward_only, num_datums=len(call.data), sparse_inputs=sparse_inputs)
    return future_response(await run_in_threadpool(service.submit, owner, call))


def _require_seq_id(seq_id: int | None) -> int:
    if seq_id is None:
        raise BadRequest("seq_id: expected an integer >= 1, got none")
    return seq_id


def _parse_optim_step(data):
    req = rq.parse(rq.OptimStepRequest, data)
    return req, rq.optim_params(data, req)


@router.post("/optim_step")
async def optim_step(request: Request, owner: str = Owner, service=ServiceDep):
    data = await read_json(request)
    req, params = await run_in_threadpool(_parse_optim_step, data)
    log_extra(request, model_id=req.model_id, seq_id=req.seq_id)
    sub = await run_in_threadpool(service.submit, owner,
                                  sr.OptimStepRequest(req.model_id, _require_seq_id(req.seq_id), params))
    return future_response(sub)


@router.post("/save_weights")
async def save_weights(request: Request, owner: str = Owner, service=ServiceDep):
    req = await rq.read(request, rq.SaveWeightsRequest)
    if not req.path:
        raise BadRequest("path: expected a checkpoint name, got none")
    sub = await run_in_threadpool(service.submit, owner, sr.SaveWeightsRequest(
        req.model_id, _require_seq_id(req.seq_id), req.path,
        overwrite=req.overwrite, ttl_seconds=req.ttl_seconds, user_metadata=req.user_metadata))
    return future_response(sub)


@router.post("/load_weights")
async def load_weights(request: Request, owner: str = Owner, service=ServiceDep):
    data = await rq.read_json(request)
    req = await run_in_threadpool(rq.parse, rq.LoadWeightsRequest, data)
    sub = await run_in_threadpool(service.submit, owner, sr.LoadWeightsRequest(
        req.path, req.optimizer, model_id=req.model_id, seq_id=req.seq_id,
        session_id=req.session_id, model_seq_id=req.model_seq_id, base_model=req.base_model,
        user_metadata=req.user_metadata, optimizer_config=rq.optimizer_config(data, req),
        weights_access_token=req.weights_access_token))
    return future_response(sub)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request, owner: str = Owner, service=ServiceDep):
    req = await rq.read(request, rq.SaveWeightsForSamplerRequest)
    log_extra(request, model_id=req.model_id, seq_id=req.seq_id)
    sub = await run_in_threadpool(service.submit, owner, sr.SaveWeightsForSamplerRequest(
        req.model_id, req.seq_id, req.path,
        sampling_session_seq_id=req.sampling_session_seq_id, kind=req.kind, ttl_seconds=req.ttl_seconds,
        user_metadata=req.user_metadata))
    return future_response(sub)
