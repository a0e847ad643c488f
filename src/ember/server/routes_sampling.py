"""Sampling sessions, asample, and the futures poll (docs/protocol.md §2.4, §3)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from tinker import types

from ember.server import requests as rq
from ember.server import wire
from ember.server.deps import Owner, ServiceDep, future_response, get_config, log_extra, model_response, read_json
from ember.server.errors import BadRequest, client_gone
from ember.service import requests as sr
from ember.service.api import FutureState

router = APIRouter()


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request, owner: str = Owner, service=ServiceDep):
    req = await rq.read(request, rq.CreateSamplingSessionRequest)
    resp = await run_in_threadpool(
        service.create_sampling_session, owner, req.session_id, req.sampling_session_seq_id,
        base_model=req.base_model, model_path=req.model_path,
    )
    return model_response(resp)


@router.get("/samplers/{sampling_session_id}")
async def get_sampler(sampling_session_id: str, owner: str = Owner, service=ServiceDep):
    return model_response(await run_in_threadpool(service.get_sampler, owner, sampling_session_id))


def _check_sample_request(req: rq.SampleRequest) -> str:
    if not req.sampling_session_id:
        raise BadRequest("sampling_session_id: required (create one with /api/v1/create_sampling_session)")
    _check_dmel_chunks(req.prompt)
    return req.sampling_session_id


def _target_tensor(req: rq.SampleRequest) -> types.TensorData | None:
    """The request's `target_prompt_logprobs` as the SDK's TensorData (the sampler checks
    its dtype, shape and values against the prompt and names what is wrong)."""
    t = req.target_prompt_logprobs
    if t is None:
        return None
    try:
        return types.TensorData(data=t.data, dtype=t.dtype, shape=t.shape, sparse_crow_indices=t.sparse_crow_indices,
                                sparse_col_indices=t.sparse_col_indices)
    except (ValueError, TypeError) as exc:
        raise BadRequest(f"target_prompt_logprobs: data does not fit shape {t.shape}: {exc}") from exc


def _check_dmel_chunks(prompt: types.ModelInput) -> None:
    """The SDK type parses a dmel chunk's TensorContainer lazily; parse it here, so a bad
    one is a 400 naming the chunk, not a ValueError (500) in the service's submit."""
    for j, chunk in enumerate(prompt.chunks):
        if isinstance(chunk, types.DmelChunk):
            try:
                _ = chunk.length
            except ValueError as exc:
                raise BadRequest(f"prompt.chunks[{j}]: dmel: {exc}") from exc


@router.post("/asample")
async def asample(request: Request, owner: str = Owner, service=ServiceDep):
    req = await rq.read(request, rq.SampleRequest)
    session = _check_sample_request(req)
    log_extra(request, sampling_session_id=session, seq_id=req.seq_id)
    sub = await run_in_threadpool(service.submit, owner, sr.SampleRequest(
        session, req.seq_id, req.prompt, req.num_samples, req.sampling_params,
        include_prompt_logprobs=bool(req.prompt_logprobs), topk_prompt_logprobs=req.topk_prompt_logprobs,
        topk_sample_logprobs=req.topk_sample_logprobs, prompt_logprobs_last_n=req.prompt_logprobs_last_n,
        target_prompt_logprobs=_target_tensor(req), prompt_alt_tokens_k=req.prompt_alt_tokens_k,
        record_stability_info=bool(req.record_stability_info)))
    return future_response(sub)


@router.post("/retrieve_future")
async def retrieve_future(request: Request, owner: str = Owner, service=ServiceDep):
    req = await rq.read(request, rq.FutureRetrieveRequest)
    state = await _unless_hung_up(request, service.retrieve_async(owner, req.request_id,
                                                                  timeout_s=get_config(request).long_poll_s))
    if state is None:
        return client_gone(request, f"long-poll of {req.request_id}")
    log_extra(request, request_id=req.request_id, status=state.status, request_type=state.request_type)
    if state.status == "pending":
        return JSONResponse({"type": "try_again", "request_id": req.request_id, "queue_state": state.queue_state})
    if state.status == "failed":
        category = types.RequestErrorCategory(state.category or types.RequestErrorCategory.Unknown)
        return JSONResponse({"error": state.error or "request failed", "category": category.value})
    wants_proto = wire.PROTOBUF_CONTENT_TYPE in request.headers.get("accept", "")
    response = await run_in_threadpool(encode_result, state, wants_proto)
    if req.allow_metadata_only and len(response.body) > get_config(request).inline_result_bytes:
        # the SDK reserves this many bytes of its in-flight budget, then polls again for them
        log_extra(request, metadata_only=True)
        return JSONResponse({"status": "complete_metadata", "response_payload_size": len(response.body)})
    return response


async def _hung_up(request: Request) -> None:
    """Returns when the client closes the connection: the body is read, so the next ASGI
    message can only be `http.disconnect`."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_hung_up(request: Request, poll: Awaitable[FutureState]) -> FutureState | None:
    """The poll's state, or None when the client hung up first: the held poll is released
    at once instead of waiting out its long-poll for nobody (the future itself is kept)."""
    poll_task, gone_task = asyncio.ensure_future(poll), asyncio.ensure_future(_hung_up(request))
    try:
        await asyncio.wait({poll_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (poll_task, gone_task):
            task.cancel()
    return poll_task.result() if poll_task.done() and not poll_task.cancelled() else None


def encode_result(state: FutureState, wants_proto: bool) -> Response:
    """Protobuf for ForwardBackwardOutput / SampleResponse when the client accepts it
    (SDK 0.38 requires it); JSON for everything else and for older JSON-only clients."""
    result = state.result
    if isinstance(result, types.ForwardBackwardOutput):
        result = types.ForwardBackwardOutput(loss_fn_output_type=result.loss_fn_output_type,
                                             loss_fn_outputs=result.loss_fn_outputs,
                                             metrics=wire.sanitize_metrics(result.metrics))
        if wants_proto:
            return Response(wire.encode_forward_backward_output(result), media_type=wire.PROTOBUF_CONTENT_TYPE)
    elif isinstance(result, types.SampleResponse) and wants_proto:
        return Response(wire.encode_sample_response(result), media_type=wire.PROTOBUF_CONTENT_TYPE)
    elif isinstance(result, types.OptimStepResponse) and result.metrics:
        result = types.OptimStepResponse(metrics=wire.sanitize_metrics(result.metrics))
    return model_response(result)
