"""OpenAI-compatible routes: `/v1/completions`, `/v1/chat/completions`, `/v1/models`.

So evaluation tools built on the `openai` client can score base models and checkpoints.
`model` is a registered base-model name or a `tinker://<run>/sampler_weights/<name>`
(or `.../weights/<name>`) path the API key may read; anything else is a 404 in OpenAI's
error shape. Sampling goes through the same `ServiceAPI.sample` as the Tinker routes, so
limits, isolation and numerics are the sampler's: greedy `temperature=0` tokens and the
logprobs equal what `SamplingClient.sample` returns for the same prompt and seed.

Sampling sessions: each API key gets one internal client session (tag "openai", kept
alive by a heartbeat on every request; recreated when it was finished or expired), and
one sampling session per (key, model) in it, cached so a repeated model does not reload
weights. `stream=true` answers as server-sent events (`oa.StreamChunks`) while the
sampler decodes: text as its tokens are drawn, each choice's logprobs with its end, the
usage last when asked; a client that hangs up cancels its sample and frees its slots
(`_stream`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import itertools
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from tinker import types

from ember.models import load_tokenizer
from ember.models.families.base import VISION_TOKENS
from ember.server import openai_compat as oa
from ember.server import requests as rq
from ember.server.deps import Owner, ServiceDep, read_json
from ember.server.errors import BadRequest
from ember.server.wire import json_safe
from ember.service.api import NotFoundError, ServiceAPI, SessionGoneError, UserError
from ember.service.requests import SampleRequest
from ember.service.limits import Limits

router = APIRouter()
POLL_S = 30.0
IMAGE_PLACEHOLDER = VISION_TOKENS[2]  # the Qwen-VL families' `<|image_pad|>`: where a chat template puts an image


class ModelNotFound(Exception):
    """`model` names nothing this key may sample (-> 404, code model_not_found)."""


class SamplerCache:
    """(owner, model) -> (sampling_session_id, tokenizer), over one session per owner."""

    def __init__(self, service: ServiceAPI) -> None:
        self.service = service
        self._lock = threading.Lock()
        self._sessions: dict[str, str] = {}
        self._samplers: dict[tuple[str, str], tuple[str, Any]] = {}
        self._seq = itertools.count()

    def get(self, owner: str, model: str) -> tuple[str, Any]:
        with self._lock:  # one creation at a time: a model is loaded once
            session = self._live_session(owner)
            found = self._samplers.get((owner, model))
            if found is None:
                found = self._create(owner, session, model)
                self._samplers[(owner, model)] = found
            return found

    def drop(self, owner: str, model: str) -> None:
        with self._lock:
            self._samplers.pop((owner, model), None)

    def _live_session(self, owner: str) -> str:
        session = self._sessions.get(owner)
        if session is not None:
            try:
                self.service.heartbeat(owner, session)
                return session
            except (SessionGoneError, NotFoundError):
                pass
        session = self.service.create_session(owner, tags=["openai"], display_name="openai-compat").session_id
        self._sessions[owner] = session
        for key in [k for k in self._samplers if k[0] == owner]:
            del self._samplers[key]  # they died with the old session
        return session

    def _create(self, owner: str, session: str, model: str) -> tuple[str, Any]:
        is_path = model.startswith("tinker://")
        try:
            sid = self.service.create_sampling_session(
                owner, session, next(self._seq), base_model=None if is_path else model,
                model_path=model if is_path else None).sampling_session_id
            base = self.service.get_sampler(owner, sid).base_model
        except UserError as exc:  # unknown base model, unknown or foreign path
            raise ModelNotFound(f"The model {model!r} does not exist or you do not have access to it ({exc})") from exc
        return sid, _tokenizer(self.service.base_model_directory(base))


@functools.lru_cache(maxsize=16)
def _tokenizer(directory: str) -> Any:
    return load_tokenizer(directory)


def sampler_cache(request: Request, service: ServiceAPI) -> SamplerCache:
    cache = getattr(request.app.state, "openai_samplers", None)
    if cache is None:
        cache = request.app.state.openai_samplers = SamplerCache(service)
    return cache


def _parse(model: type[pydantic.BaseModel], body: Any, limits: Limits, default_max_tokens: int):
    """The request and its sampling params; unsupported fields and sizes over the limits are 400s."""
    if not isinstance(body, dict):
        raise BadRequest(f"body: expected a JSON object, got {type(body).__name__}")
    req = model.model_validate(body)
    try:
        req.check_supported()
        params = req.sampling_params(default_max_tokens)
        req.check_limits(limits, params)
    except oa.Unsupported as exc:
        raise BadRequest(str(exc)) from exc
    return req, params


async def _read_request(request: Request, model: type[pydantic.BaseModel], default_max_tokens: int):
    """The body decoded (`rq.decode_json`) and validated in the thread pool, not the event loop."""
    limits = rq.limits_of(request)
    raw = await rq.read_body(request, limits)
    return await run_in_threadpool(lambda: _parse(model, rq.decode_json(raw, limits), limits, default_max_tokens))


def _json(body: Any) -> bytes:
    try:
        return b"".join(json_pieces(body))
    except ValueError:  # a -inf logprob: JSON has no infinity (see wire.json_safe)
        return b"".join(json_pieces(json_safe(body)))


def _answer(body: dict[str, Any], limits: Limits) -> Response:
    """The JSON answer; refused (400) when it is over `max_openai_response_bytes`. Runs in
    the thread pool: an answer of a few hundred thousand logprob entries takes seconds to
    build. (`stream=true` answers are sent as they are sampled: `_stream`.)"""
    raw = _json(body)
    if len(raw) > limits.max_openai_response_bytes:
        raise BadRequest(f"the answer is {len(raw)} bytes; the limit is max_openai_response_bytes="
                         f"{limits.max_openai_response_bytes} (ask for fewer choices, tokens or logprobs)")
    return Response(raw, media_type="application/json")


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + _json(chunk) + b"\n\n"


TokenEvent = tuple[int, list[int]]  # (sample, its new tokens)


DISCONNECT_POLL_S = 0.5  # how often a stream waiting for its first token checks that its client is there


class ClientGone(Exception):
    """The client of a stream hung up before its first token (queued behind other requests)."""


async def _first_event(request: Request, events: asyncio.Queue) -> Any:
    """The stream's first event, watching the client meanwhile: a request can wait long for
    a slot, and a client gone in that time must not keep its place in the queue."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), timeout=DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                raise ClientGone from None


async def _stream(request: Request, owner: str, service: ServiceAPI, req: oa._Common, prompt: types.ModelInput,
                  prompt_len: int, params: types.SamplingParams, topk: int, logprobs_of) -> Response:
    """`stream=true`: server-sent events as the sampler decodes (`Sampler.streams_tokens`;
    other backends send each choice whole at its end). The request is submitted like a
    non-streamed one (same limits, queues and fair shares); the answer starts once the
    first tokens exist, so a request refused at once is an HTTP error, not an event. A
    client that hangs up cancels the sample: its sampler slots are freed at the next step."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[TokenEvent | None] = asyncio.Queue()

    def on_tokens(sample: int, tokens, _logprobs) -> None:  # on the sampler's thread
        loop.call_soon_threadsafe(events.put_nowait, (sample, list(tokens)))

    sub, tokenizer = await _submit(request, owner, service, req.model, prompt, req.n, params, topk, on_tokens)
    settled = asyncio.ensure_future(_settled(service, owner, sub.request_id))
    settled.add_done_callback(lambda _: events.put_nowait(None))  # after every token event (FIFO)
    try:
        first = await _first_event(request, events)
    except (asyncio.CancelledError, ClientGone) as exc:
        settled.cancel()
        service.cancel_sample(owner, sub.request_id)
        if isinstance(exc, asyncio.CancelledError):
            raise
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    if first is None:
        _sequences(settled.result())  # a request refused or failed before its first token: an HTTP error
    body = _stream_events(service, owner, sub.request_id, req, params, tokenizer, events, first, settled,
                          (prompt_len, logprobs_of))
    return StreamingResponse(body, media_type="text/event-stream")


async def _stream_events(service: ServiceAPI, owner: str, request_id: str, req: oa._Common,
                         params: types.SamplingParams, tokenizer: Any, events: asyncio.Queue, first: Any,
                         settled: asyncio.Future, answer: tuple[int, Any]) -> AsyncIterator[bytes]:
    """The chunks: text as tokens come, then each choice's end, the usage, `[DONE]`; if the
    client goes away first (the generator is closed or cancelled), the sample is cancelled."""
    stop = params.stop or []
    texts = [oa.TextStream(tokenizer, stop) for _ in range(req.n)]
    chunks = oa.StreamChunks(isinstance(req, oa.ChatRequest), req.model, req.include_usage())
    finished = False
    try:
        if chunks.chat:
            for index in range(req.n):
                yield _event(chunks.start(index))
        event = first  # None: the request ended without a token (max_tokens=0)
        while event is not None:
            pending = [event]
            ended = _drain(events, pending)  # what is queued already joins this chunk
            for sample, tokens in _merged(pending):
                text = texts[sample].push(tokens)
                if text:
                    yield _event(chunks.text(sample, text))
            event = None if ended else await events.get()
        finished = True
        state = settled.result()
        if state.status == "failed":
            yield _event(oa.error_body(state.error or "sampling failed", 500 if state.category !=
                                       types.RequestErrorCategory.User else 400))
            return
        for chunk in _closing_chunks(chunks, texts, state.result.sequences, tokenizer, stop, answer):
            yield _event(chunk)
        yield b"data: [DONE]\n\n"
    finally:
        if not finished:  # closed or cancelled mid-stream: the client hung up
            settled.cancel()
            service.cancel_sample(owner, request_id)


def _drain(events: asyncio.Queue, pending: list[TokenEvent]) -> bool:
    """Move the queued token events into `pending`; True when the end (None) was among them."""
    while not events.empty():
        event = events.get_nowait()
        if event is None:
            return True
        pending.append(event)
    return False


def _merged(pending: list[TokenEvent]) -> list[TokenEvent]:
    """Consecutive events of one sample as one (fewer, larger chunks when the loop falls behind)."""
    merged: list[TokenEvent] = []
    for sample, tokens in pending:
        if merged and merged[-1][0] == sample:
            merged[-1][1].extend(tokens)
        else:
            merged.append((sample, list(tokens)))
    return merged


def _closing_chunks(chunks: oa.StreamChunks, texts: list[oa.TextStream], seqs, tokenizer: Any, stop,
                    answer: tuple[int, Any]) -> list[dict[str, Any]]:
    """Per choice: the text not sent yet, then its finish (with its logprobs); then the usage."""
    prompt_len, logprobs_of = answer
    out: list[dict[str, Any]] = []
    for index, seq in enumerate(seqs):
        rest = texts[index].finish(oa.completion_text(tokenizer, seq, stop))
        if rest:
            out.append(chunks.text(index, rest))
        out.append(chunks.finish(index, logprobs_of(tokenizer, seq), oa.finish_reason(seq)))
    if chunks.include_usage:
        out.append(chunks.usage(oa.usage(prompt_len, seqs)))
    return out


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def json_pieces(value: Any, depth: int = 0) -> Iterator[bytes]:
    """`value` as JSON, in pieces: the envelope, choices and logprobs objects are walked,
    and lists below them (token entries) encoded 64 items per `json.dumps` call. One call
    over a whole 8 MB answer held the interpreter lock, and so the event loop, for seconds."""
    if isinstance(value, dict) and depth < 4:
        yield b"{"
        for i, (key, item) in enumerate(value.items()):
            yield (b"," if i else b"") + _dumps(str(key)) + b":"
            yield from json_pieces(item, depth + 1)
        yield b"}"
    elif isinstance(value, list):
        yield b"["
        if depth < 3:
            for i, item in enumerate(value):
                yield b"," if i else b""
                yield from json_pieces(item, depth + 1)
        else:
            for i in range(0, len(value), 64):
                yield (b"," if i else b"") + _dumps(value[i:i + 64])[1:-1]
        yield b"]"
    else:
        yield _dumps(value)


async def _submit(request: Request, owner: str, service: ServiceAPI, model: str, prompt: types.ModelInput, n: int,
                  params: types.SamplingParams, topk: int, on_tokens=None) -> tuple[Any, Any]:
    """(the submission, the model's tokenizer): once more on a fresh sampler if the cached one is gone."""
    cache = sampler_cache(request, service)
    for attempt in range(2):
        sid, tokenizer = await run_in_threadpool(cache.get, owner, model)
        try:
            sub = await run_in_threadpool(service.submit, owner, SampleRequest(
                sid, None, prompt, n, params, topk_sample_logprobs=topk, on_tokens=on_tokens))
        except NotFoundError:
            cache.drop(owner, model)
            if attempt:
                raise
            continue
        return sub, tokenizer
    raise AssertionError("unreachable")


async def _settled(service: ServiceAPI, owner: str, request_id: str) -> Any:
    """The request's final `FutureState`, awaited on the event loop."""
    state = await service.retrieve_async(owner, request_id, timeout_s=POLL_S)
    while not state.done:
        state = await service.retrieve_async(owner, request_id, timeout_s=POLL_S)
    return state


def _sequences(state: Any) -> list[types.SampledSequence]:
    if state.status == "failed":
        if state.category == types.RequestErrorCategory.User:
            raise BadRequest(state.error or "sampling failed")
        raise RuntimeError(state.error or "sampling failed")
    return list(state.result.sequences)


async def sample_prompt(request: Request, owner: str, service: ServiceAPI, model: str, prompt: types.ModelInput,
                        n: int, params: types.SamplingParams, topk: int) -> tuple[list[types.SampledSequence], Any]:
    """Sample on `model` for `owner`: the sequences and the model's tokenizer."""
    sub, tokenizer = await _submit(request, owner, service, model, prompt, n, params, topk)
    return _sequences(await _settled(service, owner, sub.request_id)), tokenizer


def _not_found(exc: ModelNotFound) -> JSONResponse:
    return JSONResponse(oa.error_body(str(exc), 404, code="model_not_found"), status_code=404)


@router.post("/completions")
async def completions(request: Request, owner: str = Owner, service=ServiceDep):
    req, params = await _read_request(request, oa.CompletionRequest, oa.DEFAULT_MAX_TOKENS)
    try:
        _, tokenizer = await run_in_threadpool(sampler_cache(request, service).get, owner, req.model)
    except ModelNotFound as exc:
        return _not_found(exc)
    prompt = req.single_prompt()
    ids = await run_in_threadpool(tokenizer.encode, prompt, add_special_tokens=False) if isinstance(prompt, str) \
        else list(prompt)
    offset0 = len(prompt) if isinstance(prompt, str) else 0
    try:  # the checkpoint may have gone since the sampler was cached (unpublished, expired, deleted)
        if req.stream:
            return await _stream(request, owner, service, req, types.ModelInput.from_ints(ids), len(ids), params,
                                 req.logprobs or 0,
                                 lambda tok, s: oa.completion_logprobs(tok, s, offset0) if req.logprobs is not None
                                 else None)
        seqs, tokenizer = await sample_prompt(request, owner, service, req.model, types.ModelInput.from_ints(ids),
                                              req.n, params, req.logprobs or 0)
    except ModelNotFound as exc:
        return _not_found(exc)
    return await run_in_threadpool(_completion_answer, req, params, tokenizer, prompt, ids, seqs, rq.limits_of(request))


def _completion_answer(req, params, tokenizer, prompt, ids, seqs, limits: Limits) -> Response:
    offset0 = len(prompt) if isinstance(prompt, str) else 0
    choices = [{"index": i, "text": oa.completion_text(tokenizer, s, params.stop or []),
                "logprobs": oa.completion_logprobs(tokenizer, s, offset0) if req.logprobs is not None else None,
                "finish_reason": oa.finish_reason(s)} for i, s in enumerate(seqs)]
    return _answer(oa.envelope("text_completion", req.model, choices, oa.usage(len(ids), seqs)), limits)


@router.post("/chat/completions")
async def chat_completions(request: Request, owner: str = Owner, service=ServiceDep):
    req, params = await _read_request(request, oa.ChatRequest, oa.DEFAULT_CHAT_MAX_TOKENS)
    try:
        messages, images = oa.chat_messages(req.messages)
        _, tokenizer = await run_in_threadpool(sampler_cache(request, service).get, owner, req.model)
    except oa.Unsupported as exc:
        raise BadRequest(str(exc)) from exc
    except ModelNotFound as exc:
        return _not_found(exc)
    prompt = await run_in_threadpool(chat_prompt, req.model, tokenizer, messages, images)
    ids = prompt.to_ints() if not images else [t for c in prompt.chunks for t in getattr(c, "tokens", [0])]
    try:
        if req.stream:
            return await _stream(request, owner, service, req, prompt, len(ids), params, req.topk(),
                                 lambda tok, s: oa.chat_logprobs(tok, s) if req.logprobs else None)
        seqs, tokenizer = await sample_prompt(request, owner, service, req.model, prompt, req.n, params, req.topk())
    except ModelNotFound as exc:
        return _not_found(exc)
    return await run_in_threadpool(_chat_answer, req, params, tokenizer, ids, seqs, rq.limits_of(request))


def chat_prompt(model: str, tokenizer: Any, messages: list[dict[str, Any]],
                 images: list[oa.ChatImage]) -> types.ModelInput:
    """The templated conversation as a `ModelInput`: the template writes each image's
    placeholder token where it goes; that token becomes the image's chunk (the sampler
    expands it to the model's own run, as for an SDK `ImageChunk`)."""
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequest(f"model {model!r}: its tokenizer has no chat template; use /v1/completions")
    placeholder = tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER) if images else None
    if images and (placeholder is None or placeholder == tokenizer.unk_token_id):
        raise BadRequest(f"model {model!r} takes text only: it has no image placeholder token")
    # The template's text, then its tokens (transformers' tokenize=True return type varies by version).
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not images:
        return types.ModelInput.from_ints(ids)
    cuts = [k for k, t in enumerate(ids) if t == placeholder]
    if len(cuts) != len(images):
        raise BadRequest(f"model {model!r}: its chat template placed {len(cuts)} image placeholders for "
                         f"{len(images)} images")
    chunks: list[Any] = []
    start = 0
    for k, (data, fmt) in zip(cuts, images):
        if k > start:
            chunks.append(types.EncodedTextChunk(tokens=ids[start:k]))
        chunks.append(types.ImageChunk(data=data, format=fmt))
        start = k + 1
    if start < len(ids):
        chunks.append(types.EncodedTextChunk(tokens=ids[start:]))
    return types.ModelInput(chunks=chunks)


def _chat_answer(req, params, tokenizer, ids, seqs, limits: Limits) -> Response:
    choices = [{"index": i,
                "message": {"role": "assistant", "content": oa.completion_text(tokenizer, s, params.stop or [])},
                "logprobs": oa.chat_logprobs(tokenizer, s) if req.logprobs else None,
                "finish_reason": oa.finish_reason(s)} for i, s in enumerate(seqs)]
    return _answer(oa.envelope("chat.completion", req.model, choices, oa.usage(len(ids), seqs)), limits)


@router.get("/models")
async def list_models(owner: str = Owner, service=ServiceDep):
    """The base models, then the caller's own sampler checkpoints (newest first, at most
    MODELS_LISTED_CHECKPOINTS): every id here is a valid `model`."""
    caps = await run_in_threadpool(service.get_server_capabilities)
    data = [{"id": m.model_name, "object": "model", "created": 0, "owned_by": "ember"}
            for m in caps.supported_models if m.model_name]
    listed = await run_in_threadpool(service.list_user_checkpoints, owner, MODELS_LISTED_CHECKPOINTS, 0)
    data += [{"id": c.tinker_path, "object": "model", "created": int(c.time.timestamp()), "owned_by": owner}
             for c in listed.checkpoints if c.checkpoint_type == "sampler"]
    return JSONResponse({"object": "list", "data": data})


MODELS_LISTED_CHECKPOINTS = 1000
