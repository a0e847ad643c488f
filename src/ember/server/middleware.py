"""Pure ASGI middleware: body-size limit, path prefix, and an optional JSONL request log."""

from __future__ import annotations

import itertools
import json
import os
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
_EXTRA_LIMIT = 512  # characters of a compact line's `extra` (a telemetry batch may name many events)
REQUEST_LOG_MAX_BYTES = 64 << 20  # the request log rotates past this size (one old file kept)
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
    """One JSON line per request, appended to `path`: arrival order `n`, arrival time `t`,
    `ms` to the answer, method, path, status and what the route put in `ember_log` (the
    decoded run, seq_id, loss, ...; dropped when over `_EXTRA_LIMIT` characters), about 200
    bytes. `bodies=True` (`--request-log-bodies`, for debugging and the tests) adds chosen
    headers, `t_end` and small JSON bodies, request and response. Past `max_bytes` the
    file is renamed to `<path>.1` (replacing the previous one) and a new one begun, so the
    log never holds more than twice that."""

    def __init__(self, app: ASGIApp, path: str, bodies: bool = False, max_bytes: int = REQUEST_LOG_MAX_BYTES):
        self.app, self.path, self.bodies, self.max_bytes = app, path, bodies, max_bytes
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (lives with the app)
        self._size = self._file.tell()
        self._lock = threading.Lock()
        self._counter = itertools.count()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        entry: dict[str, Any] = {"n": next(self._counter), "t": time.time(), "method": scope["method"],
                                 "path": scope["path"]}
        if self.bodies:
            entry["headers"] = {h: v for h in _LOGGED_HEADERS if (v := _header(scope, h.encode())) is not None}
        request_body, response_body = bytearray(), bytearray()
        state = scope.setdefault("state", {})
        written = False

        def write_once() -> None:
            nonlocal written
            if not written:
                written = True
                self._write(self._finish(entry, state, request_body, response_body))

        async def logged_receive() -> Message:
            message = await receive()
            if self.bodies and message["type"] == "http.request" and len(request_body) < _LOG_BODY_LIMIT:
                request_body.extend(message.get("body", b""))
            return message

        async def logged_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                entry["status"] = message["status"]
                if self.bodies:
                    entry["response_type"] = next((v.decode() for k, v in message.get("headers", ())
                                                   if k.lower() == b"content-type"), None)
            elif message["type"] == "http.response.body":
                if self.bodies and len(response_body) < _LOG_BODY_LIMIT:
                    response_body.extend(message.get("body", b""))
                if not message.get("more_body", False):
                    write_once()  # before the answer's last bytes leave: no client sees it unlogged
            await send(message)

        try:
            await self.app(scope, logged_receive, logged_send)
        finally:
            write_once()  # an answer never finished (an error, a client gone)

    def _finish(self, entry: dict[str, Any], state: dict, request_body: bytearray, response_body: bytearray) -> str:
        now = time.time()
        entry["ms"] = round((now - entry["t"]) * 1000, 1)
        extra = state.get(LOG_STATE_KEY)
        entry["extra"] = extra if extra is None or len(json.dumps(extra, default=str)) <= _EXTRA_LIMIT \
            else {"dropped": f"over {_EXTRA_LIMIT} characters"}
        if self.bodies:
            entry.update(t_end=now, json=_maybe_json(request_body), response=_maybe_json(response_body))
        # a download link's token is a credential: kept out of paths and logged answers
        return _DOWNLOAD_TOKEN.sub(r"\1<token>/", json.dumps(entry, default=str)) + "\n"

    def _write(self, line: str) -> None:
        with self._lock:
            if self._size + len(line) > self.max_bytes and self._size > 0:
                self._file.close()
                os.replace(self.path, self.path + ".1")
                self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
                self._size = 0
            self._file.write(line)
            self._size += len(line.encode())


def _maybe_json(raw: bytes | bytearray) -> Any:
    if not raw or len(raw) >= _LOG_BODY_LIMIT:
        return None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):  # 64 kB may nest 32,000 deep
        return None
