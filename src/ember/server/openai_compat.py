"""OpenAI request and response shapes, translated to and from tinker sampling (pure).

`/v1/completions` and `/v1/chat/completions` (`ember.server.routes_openai`) parse their
bodies with the request models here, turn them into a prompt and `SamplingParams`, and
turn the sampler's `SampledSequence`s back into OpenAI's JSON. Fields OpenAI defines but
this server does not implement are refused (`Unsupported`, a 400) when set to anything
but their neutral value, so an evaluation never silently runs with different settings;
unknown fields are ignored.
"""

from __future__ import annotations

import base64
import binascii
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar, Optional, Union

import pydantic
from pydantic import ConfigDict, Field
from tinker import types

# OpenAI's default `max_tokens` for /v1/completions; chat has none (until the model
# stops), so chat uses the same finite default unless the caller sets one.
DEFAULT_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 256


class Unsupported(ValueError):
    """A request field this server does not implement (-> 400)."""


class _Common(pydantic.BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model: str
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(1, ge=1)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[dict[str, Any]] = None
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    logit_bias: Optional[dict[str, float]] = None
    best_of: Optional[int] = None

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise Unsupported("stream_options: only with stream=true")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise Unsupported(f"{name}: not supported by this server (got {getattr(self, name)}); leave it 0")
        if self.logit_bias:
            raise Unsupported("logit_bias: not supported by this server")
        if self.best_of not in (None, 1, self.n):
            raise Unsupported(f"best_of: only best_of = n is supported (got {self.best_of}, n = {self.n})")

    def include_usage(self) -> bool:
        """`stream_options.include_usage`: a last chunk with the usage (and `usage: null` before)."""
        return bool(self.stream and (self.stream_options or {}).get("include_usage"))

    def check_limits(self, limits: Any, params: types.SamplingParams) -> None:
        """`n`, the top-logprob count and the logprob entries the answer would hold, bounded
        before anything is sampled (an answer is built in memory, then sent)."""
        if self.n > limits.max_openai_n:
            raise Unsupported(f"n: {self.n} is over the limit max_openai_n={limits.max_openai_n}")
        top = self.top_count()
        if top > limits.max_openai_top_logprobs:
            raise Unsupported(f"{self.TOP_FIELD}: {top} is over the limit "
                              f"max_openai_top_logprobs={limits.max_openai_top_logprobs}")
        if self.wants_logprobs():
            entries = self.n * max(int(params.max_tokens or 0), 1) * (1 + top)
            if entries > limits.max_openai_logprob_entries:
                raise Unsupported(f"n x max_tokens x (1 + {self.TOP_FIELD}) = {self.n} x {params.max_tokens} x "
                                  f"{1 + top} = {entries} logprob entries; the limit is "
                                  f"max_openai_logprob_entries={limits.max_openai_logprob_entries}")

    TOP_FIELD: ClassVar[str] = "logprobs"

    def top_count(self) -> int:
        return 0

    def wants_logprobs(self) -> bool:
        return False

    def sampling_params(self, default_max_tokens: int) -> types.SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or None)
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        return types.SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                                    seed=self.seed, stop=stop)


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0)
    echo: Optional[bool] = False
    suffix: Optional[str] = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise Unsupported("echo: not supported by this server; send echo=false")
        if self.suffix:
            raise Unsupported("suffix: not supported by this server")
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            if len(self.prompt) != 1:
                raise Unsupported(f"prompt: one prompt per request (got a list of {len(self.prompt)}); "
                                  "send the prompts as separate requests")
        if isinstance(self.prompt, list) and not self.prompt:
            raise Unsupported("prompt: empty list")

    def top_count(self) -> int:
        return self.logprobs or 0

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def single_prompt(self) -> Union[str, list[int]]:
        p = self.prompt
        return p[0] if isinstance(p, list) and p and not isinstance(p[0], int) else p


class ChatRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0)
    tools: Optional[list[Any]] = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise Unsupported("tools: tool calls are not supported by this server")
        if self.top_logprobs and not self.logprobs:
            raise Unsupported("top_logprobs: needs logprobs=true")

    def sampling_params(self, default_max_tokens: int) -> types.SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens)

    TOP_FIELD: ClassVar[str] = "top_logprobs"

    def topk(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    def top_count(self) -> int:
        return self.top_logprobs or 0

    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)


ChatImage = tuple[bytes, str]  # (png/jpeg bytes, "png" | "jpeg")
_DATA_URL = re.compile(r"data:image/(png|jpeg|jpg);base64,", re.IGNORECASE)


def chat_messages(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ChatImage]]:
    """Messages as the chat template takes them, and their images in order.

    Text parts are joined into one string; a message with `image_url` parts keeps its
    parts (text ones, and `{"type": "image"}` where each image goes: the model's template
    writes its placeholder there). An image is a `data:image/png|jpeg;base64,...` URL
    only: ember never fetches a URL (`http(s):`, `file:` and the rest are refused)."""
    out: list[dict[str, Any]] = []
    images: list[ChatImage] = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise Unsupported(f"messages[{i}].role: expected a string, got {role!r:.40}")
        if isinstance(content, list):
            content = _content_parts(i, content, images)
        if not isinstance(content, (str, list)):
            raise Unsupported(f"messages[{i}].content: expected a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out, images


def _content_parts(i: int, parts: list, images: list[ChatImage]) -> str | list[dict[str, str]]:
    kinds = [p.get("type") if isinstance(p, dict) else None for p in parts]
    if any(kind not in ("text", "image_url") for kind in kinds):
        raise Unsupported(f"messages[{i}].content: only text and image_url parts are supported")
    if "image_url" not in kinds:
        return "".join(str(p.get("text", "")) for p in parts)
    out = []
    for j, part in enumerate(parts):
        if part["type"] == "text":
            out.append({"type": "text", "text": str(part.get("text", ""))})
            continue
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        images.append(decode_data_url(url, f"messages[{i}].content[{j}].image_url.url"))
        out.append({"type": "image"})
    return out


def decode_data_url(url: Any, where: str) -> ChatImage:
    """(bytes, format) of a base64 `data:` URL of a png or jpeg image (Unsupported otherwise)."""
    if not isinstance(url, str):
        raise Unsupported(f"{where}: expected a string, got {type(url).__name__}")
    match = _DATA_URL.match(url)
    if match is None:
        raise Unsupported(f"{where}: only data:image/png;base64 or data:image/jpeg;base64 URLs are accepted "
                          f"(ember never fetches a URL), got {url[:40]!r}")
    try:
        data = base64.b64decode(url[match.end():], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise Unsupported(f"{where}: the base64 data is invalid ({exc})") from None
    return data, "png" if match.group(1).lower() == "png" else "jpeg"


# ------------------------------------------------------------------ responses
def finish_reason(seq: types.SampledSequence) -> str:
    return "length" if seq.stop_reason == "length" else "stop"


def completion_text(tokenizer: Any, seq: types.SampledSequence, stop: Sequence[str]) -> str:
    """The decoded completion without special tokens and, as OpenAI does, without the
    stop string that ended it (the tokens and logprobs still include it)."""
    text = tokenizer.decode(seq.tokens, skip_special_tokens=True)
    if seq.stop_reason == "stop":
        for s in stop:
            if s and s in text:
                return text[: text.index(s)]
    return text


class _Tokens:
    """Token id -> its text and UTF-8 bytes, decoded once per answer: a logprobs answer
    names the same few thousand tokens 100k times."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self._seen = tokenizer, {}

    def entry(self, token: int) -> tuple[str, list[int]]:
        found = self._seen.get(token)
        if found is None:
            text = self.tokenizer.decode([token])
            found = self._seen[token] = (text, list(text.encode("utf-8")))
        return found

    def text(self, token: int) -> str:
        return self.entry(token)[0]


def completion_logprobs(tokenizer: Any, seq: types.SampledSequence, text_offset0: int) -> dict[str, Any]:
    """OpenAI's legacy `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset."""
    names = _Tokens(tokenizer)
    tokens = [names.text(t) for t in seq.tokens]
    offsets, at = [], text_offset0
    for s in tokens:
        offsets.append(at)
        at += len(s)
    top = None
    if seq.topk_logprobs is not None:
        top = [{names.text(t): lp for t, lp in sorted(row or [], key=lambda r: -r[1])} for row in seq.topk_logprobs]
    return {"tokens": tokens, "token_logprobs": list(seq.logprobs or []), "top_logprobs": top,
            "text_offset": offsets}


def _chat_entry(names: _Tokens, token: int, logprob: float) -> dict[str, Any]:
    text, raw = names.entry(token)
    return {"token": text, "logprob": logprob, "bytes": raw}


def chat_logprobs(tokenizer: Any, seq: types.SampledSequence) -> dict[str, Any]:
    """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    names = _Tokens(tokenizer)
    tops = seq.topk_logprobs or [None] * len(seq.tokens)
    content = []
    for token, lp, row in zip(seq.tokens, seq.logprobs or [], tops, strict=False):
        entry = _chat_entry(names, token, lp)
        entry["top_logprobs"] = [_chat_entry(names, t, v) for t, v in (row or [])]
        content.append(entry)
    return {"content": content}


def usage(prompt_tokens: int, seqs: Sequence[types.SampledSequence]) -> dict[str, int]:
    completion = sum(len(s.tokens) for s in seqs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def envelope(kind: str, model: str, choices: list[dict], usage_: dict[str, int]) -> dict[str, Any]:
    prefix = "cmpl" if kind == "text_completion" else "chatcmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage_}


class TextStream:
    """One choice's text as its tokens arrive (pure): `push` returns the text to send now,
    `finish` the rest once the final text is known.

    Tokens are decoded over a short window, as vLLM's incremental detokenizer does (the
    text of tokens[prefix:] minus that of tokens[prefix:read]), so a step costs the same
    however long the completion; text ending in an incomplete UTF-8 character ("\ufffd")
    waits for the next token. With stop strings, the last len(longest stop) - 1
    characters are held back, and nothing from a stop string on is sent: the sampler ends a
    sequence as soon as its text contains one, which the final text leaves out
    (`completion_text`), so whatever was sent stays a prefix of the final text."""

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix = self.read = 0  # the decode window: tokens[prefix:read] were decoded last time
        self.text = ""  # decoded so far
        self.sent = 0  # characters of `text` sent
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def push(self, tokens: Sequence[int]) -> str:
        self.tokens.extend(tokens)
        before = self._decode(self.tokens[self.prefix:self.read])
        now = self._decode(self.tokens[self.prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before):]
            self.prefix, self.read = self.read, len(self.tokens)
        ready = min([len(self.text) - self.holdback, *self._stop_starts()])
        if ready <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:ready], ready
        return out

    def _stop_starts(self) -> list[int]:
        """Where a stop string now in the unsent text starts (the sequence ends with it)."""
        start = max(self.sent - self.holdback, 0)
        return [found for s in self.stop if (found := self.text.find(s, start)) >= 0]

    def finish(self, final_text: str) -> str:
        """What of `final_text` (the whole answer's text) was not sent yet."""
        sent = self.text[:self.sent]
        return final_text[len(sent):] if final_text.startswith(sent) else ""


class StreamChunks:
    """OpenAI's stream chunks of one answer (pure): chat ones carry a `delta` (the role in
    each choice's first), completion ones `text`. Each choice ends with a chunk holding its
    `finish_reason` and, when asked, its logprobs (all of them: ember streams text, and
    the logprobs come with the choice's end); with `include_usage` every chunk has
    `usage: null` and a last one, without choices, the usage."""

    def __init__(self, chat: bool, model: str, include_usage: bool) -> None:
        self.chat, self.include_usage = chat, include_usage
        self.base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                     "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": model}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = {**self.base, "choices": [choice]}
        return {**chunk, "usage": None} if self.include_usage else chunk

    def start(self, index: int) -> dict[str, Any]:
        """Chat only: the choice's role."""
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def text(self, index: int, text: str) -> dict[str, Any]:
        body = {"delta": {"content": text}} if self.chat else {"text": text}
        return self._chunk({"index": index, **body, "logprobs": None, "finish_reason": None})

    def finish(self, index: int, logprobs: Any, finish_reason: str) -> dict[str, Any]:
        body = {"delta": {}} if self.chat else {"text": ""}
        return self._chunk({"index": index, **body, "logprobs": logprobs, "finish_reason": finish_reason})

    def usage(self, usage_: dict[str, int]) -> dict[str, Any]:
        return {**self.base, "choices": [], "usage": usage_}


def error_body(message: str, status: int, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")
    code = code or {401: "invalid_api_key"}.get(status)
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
