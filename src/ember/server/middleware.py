"""Pure ASGI middleware: body-size limit, path prefix, and an optional JSONL request log."""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Headers worth recording (never the API key).
_LOGGED_HEADERS = (
    "content-type",
    "content-encoding",
    "content-length",
    "accept",
    "x-tinker-request-type",
    "x-tinker-request-iteration",
    "x-sdk-method",
    "x-idempotency-key",
    "x-stainless-retry-count",
)
_LOG_BODY_LIMIT = 64 * 1024
LOG_STATE_KEY = "ember_log"  # routes put decoded facts (seq_id, ...) in request.state.ember_log


class BodyTooLarge(Exception):
    def __init__(self, limit: int, name: str | None = None):
        named = f" ({name}={limit})" if name else ""
        super().__init__(f"body: request body exceeds the limit of {limit} bytes{named}")
        self.limit = limit


async def _send_json(send: Send, status: int, body: dict[str, Any],
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": raw})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class BodyLimitMiddleware:
    """413 with a JSON body for declared (Content-Length) or streamed oversized bodies."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _send_json(send, 413, {"error": str(BodyTooLarge(self.max_bytes)), "category": "user"})
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)


class PathPrefixMiddleware:
    """Serve the API under `/<prefix>/api/v1/...`: strip the prefix, 404 anything else."""

    def __init__(self, app: ASGIApp, prefix: str):
        self.app, self.prefix = app, prefix.rstrip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.prefix:
            return await self.app(scope, receive, send)
        path: str = scope["path"]
        if path != self.prefix and not path.startswith(self.prefix + "/"):
            return await _send_json(send, 404, {"error": f"not found: {path} (the API is under {self.prefix}/)",
                                                "category": "user"})
        scope = dict(scope, path=path[len(self.prefix):] or "/", root_path=scope.get("root_path", "") + self.prefix)
        await self.app(scope, receive, send)


_DOWNLOAD_TOKEN = re.compile(r"(/external_weights/)[0-9]+\.[A-Za-z0-9_\-]+\.[A-Za-z0-9_\-]{40,}/")  # expires.path.mac


class RequestLogMiddleware:
    """One JSON line per request: arrival order `n`, times, path, status, chosen headers,
    small JSON bodies (request and response) and what the route put in `ember_log`."""

    def __init__(self, app: ASGIApp, path: str):
        self.app = app
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (lives with the app)
        self._lock = threading.Lock()
        self._counter = itertools.count()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        entry: dict[str, Any] = {
            "n": next(self._counter), "t": time.time(), "method": scope["method"],
            "path": scope["path"],
            "headers": {h: v for h in _LOGGED_HEADERS if (v := _header(scope, h.encode())) is not None},
        }
        request_body, response_body = bytearray(), bytearray()
        state = scope.setdefault("state", {})

        async def logged_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request" and len(request_body) < _LOG_BODY_LIMIT:
                request_body.extend(message.get("body", b""))
            return message

        async def logged_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                entry["status"] = message["status"]
                entry["response_type"] = next((v.decode() for k, v in message.get("headers", ())
                                               if k.lower() == b"content-type"), None)
            elif message["type"] == "http.response.body" and len(response_body) < _LOG_BODY_LIMIT:
                response_body.extend(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, logged_receive, logged_send)
        finally:
            entry["t_end"] = time.time()
            entry["json"] = _maybe_json(request_body)
            entry["response"] = _maybe_json(response_body)
            entry["extra"] = state.get(LOG_STATE_KEY)
            with self._lock:
                # a download link's token is a credential: kept out of paths and logged answers
                self._file.write(_DOWNLOAD_TOKEN.sub(r"\1<token>/", json.dumps(entry, default=str)) + "\n")


def _maybe_json(raw: bytes | bytearray) -> Any:
    if not raw or len(raw) >= _LOG_BODY_LIMIT:
        return None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):  # 64 kB may nest 32,000 deep
        return None
