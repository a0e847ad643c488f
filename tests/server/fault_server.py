"""Test-only wrapper around the real `ember serve` app that can answer in special ways.

Run with the same arguments as `ember serve`. The real app is built by
`ember.server.cli.build_app`; this script wraps it with a fault-injection middleware
(between the request log and the app, so injected answers are logged too) and control
endpoints that need no API key:

    POST /_test/faults         {"rules": [Rule, ...]}   replace the rules
    GET  /_test/faults         the rules with their remaining counts and hits
    POST /_test/client_config  {flag: value, ...}       merged into /api/v1/client/config
    POST /_test/failpoints     {"name": str, "action": str | null, "times": int}
                               arm (or, with action null, disarm) an `ember.failpoints` point
                               in the server process

A Rule: {"path": suffix, "status": int, "times": n (-1 = always), "body": JSON (default
{"error": ..., "category": "user"}), "header": {name: value} (request headers to match),
"body_contains": str (request body substring), "after": bool (forward to the real app
first, then answer the fault instead of its response), "raise": str (raise a RuntimeError
with this message inside the app instead of answering: an unhandled server fault)}.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember import failpoints
from ember.server.cli import add_arguments, build_app, load_serve_config, serve
from ember.server.middleware import RequestLogMiddleware


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}


async def _send_json(send: Send, status: int, body: Any) -> None:
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]})
    await send({"type": "http.response.body", "body": raw})


class FaultMiddleware:
    def __init__(self, app: ASGIApp, fastapi_app) -> None:
        self.app, self.fastapi_app = app, fastapi_app
        self.rules: list[dict[str, Any]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path.endswith("/_test/faults"):
            return await self._control_faults(scope, receive, send)
        if path.endswith("/_test/failpoints"):
            spec = json.loads(await _read_body(receive))
            if spec.get("action"):
                failpoints.arm(spec["name"], spec["action"], spec.get("times", -1))
            else:
                failpoints.disarm(spec.get("name"))
            return await _send_json(send, 200, spec)
        if path.endswith("/_test/client_config"):
            flags = json.loads(await _read_body(receive))
            self.fastapi_app.state.config.client_config.update(flags)
            return await _send_json(send, 200, dict(self.fastapi_app.state.config.client_config))
        body = await _read_body(receive)
        rule = self._match(path, _headers(scope), body)
        replay = _replay(body, receive)
        if rule is None:
            return await self.app(scope, replay, send)
        rule["hits"] += 1
        if rule["times"] > 0:
            rule["times"] -= 1
        if rule.get("raise"):
            raise RuntimeError(f"injected fault: {rule['raise']}")
        if rule.get("after"):
            await self.app(scope, replay, _swallow)
        default = {"error": f"injected {rule['status']}", "category": "user"}
        await _send_json(send, rule["status"], rule.get("body", default))

    def _match(self, path: str, headers: dict[str, str], body: bytes) -> dict | None:
        for rule in self.rules:
            if rule["times"] == 0 or not path.endswith(rule["path"]):
                continue
            if any(headers.get(k.lower()) != v for k, v in rule.get("header", {}).items()):
                continue
            if rule.get("body_contains") and rule["body_contains"].encode() not in body:
                continue
            return rule
        return None

    async def _control_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] == "POST":
            rules = json.loads(await _read_body(receive))["rules"]
            self.rules = [{"times": -1, **r, "hits": 0} for r in rules]
        await _send_json(send, 200, {"rules": self.rules})


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes, original: Receive) -> Receive:
    """Hand the already-read body to the app once, then wait on the real channel."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return await original()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


async def _swallow(message: Message) -> None:
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = load_serve_config(parser.parse_args(argv))
    log_path, config.server.request_log = config.server.request_log, None
    app = build_app(config)
    app.add_middleware(FaultMiddleware, fastapi_app=app)
    if log_path:
        app.add_middleware(RequestLogMiddleware, path=log_path, bodies=True)
    return serve(app, config.server.host, config.server.port, config.log_level)


if __name__ == "__main__":
    sys.exit(main())
