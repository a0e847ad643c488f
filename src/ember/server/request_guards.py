"""Slow and greedy clients: a header timeout, a body timeout and a per-key request bound.

uvicorn (h11) arms its keep-alive timer only after a response, and cancels it on the first
byte of the next request; nothing bounds how long request headers take to arrive, so a
client trickling one header byte at a time holds a connection forever (slowloris).
`header_timeout_protocol` closes such a connection; `BodyTimeoutMiddleware` answers 408
to a body that stalls; `PerKeyLimitMiddleware` answers 429 beyond N in-flight requests of
one API key. None of them parses HTTP: h11 does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import h11
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from ember.server.config import ServerConfig, presented_key
from ember.server.middleware import _send_json

logger = logging.getLogger(__name__)


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus: a request's headers (from its first byte, or from
    the connection's start for the first request) must be complete within
    `header_timeout_s`, else the connection is closed. Between requests uvicorn's
    keep-alive timeout still applies."""

    header_timeout_s: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # bytes of a request whose headers are not in yet
            self._arm_header_timer()
        super().data_received(data)
        self._cancel_header_timer_if_headers_done()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next (pipelined) request cycle
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self._arm_header_timer()  # part of a pipelined request is already buffered

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _cancel_header_timer_if_headers_done(self) -> None:
        if self.conn.their_state is not h11.IDLE:  # h11 left IDLE: the Request event is complete
            self._cancel_header_timer()

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            logger.info("closing %s: request headers not complete after %s s", self.client, self.header_timeout_s)
            self.transport.close()


def header_timeout_protocol(timeout_s: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class for `uvicorn.Config(http=...)` with this header timeout."""
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout_s": timeout_s})


class BodyTimeout(Exception):
    """The request body stalled (-> 408 and the connection closed)."""


class BodyTimeoutMiddleware:
    """Bounds the wait for request *body bytes*: `idle_s` between chunks, `deadline_s` for
    the whole body. Once the body is complete, `receive` is passed through unbounded, so a
    long-poll (retrieve_future) still holds its response as long as it needs."""

    def __init__(self, app: ASGIApp, idle_s: float, deadline_s: float):
        self.app, self.idle_s, self.deadline_s = app, idle_s, deadline_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        deadline = time.monotonic() + self.deadline_s
        body_done = False

        async def bounded_receive() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            wait_s = min(self.idle_s, deadline - time.monotonic())
            try:
                message = await asyncio.wait_for(receive(), max(wait_s, 0.0))
            except asyncio.TimeoutError:
                raise BodyTimeout(f"body: request body not received in time (idle timeout {self.idle_s} s, "
                                  f"total {self.deadline_s} s)") from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, bounded_receive, send)


class PerKeyLimitMiddleware:
    """At most `max_requests` in-flight HTTP requests per API key owner; the excess gets
    429 with Retry-After (the SDK retries it). Requests without an accepted key are not
    counted (the route answers 401)."""

    RETRY_AFTER_S = 1

    def __init__(self, app: ASGIApp, config: ServerConfig):
        self.app, self.config = app, config
        self.max_requests = config.max_requests_per_key
        self.in_flight: Counter[str] = Counter()  # one event loop: no lock needed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # the openai client's `Authorization: Bearer <key>` counts against the same key
        owner = self.config.owner_for(presented_key(Headers(scope=scope)))
        if owner is None:
            return await self.app(scope, receive, send)
        if self.in_flight[owner] >= self.max_requests:
            return await _send_json(send, 429, {
                "error": f"too many concurrent requests for this API key (max_requests_per_key = "
                         f"{self.max_requests}); retry later", "category": "user"},
                headers=[(b"retry-after", str(self.RETRY_AFTER_S).encode())])
        self.in_flight[owner] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[owner] -= 1
            if not self.in_flight[owner]:
                del self.in_flight[owner]
