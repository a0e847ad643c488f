"""Every error answer is JSON `{"error": str, "category": "user"|"server", ...}`.

The SDK turns an empty-body 400 into a retryable connection error and retries 408/409/
429/5xx for minutes (docs/protocol.md §3.3), so: malformed bodies are 400/422 with a
body, unknown ids 404, finished sessions 410, and semantic errors are never HTTP errors
at all — the service reports them through failed futures.
"""

from __future__ import annotations

import logging

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ember.server.request_guards import BodyTimeout
from ember.server.middleware import BodyTooLarge
from ember.server.wire import WireError
from ember.service.api import BusyError, NotFoundError, ServiceError, SessionGoneError, UserError
from ember.service.faults import public_message

logger = logging.getLogger(__name__)


class AuthError(Exception):
    """Missing or unknown API key (-> 401)."""


class BadRequest(ValueError):
    """A body that is not what the endpoint takes (-> 400), e.g. invalid JSON."""


# nginx's "client closed request": recorded in the request log, never seen by a client.
CLIENT_CLOSED_REQUEST = 499


def client_gone(request: Request, doing: str) -> Response:
    """One concise log line for a client that hung up, and an answer nobody will read."""
    logger.info("client closed the connection during %s %s (%s)", request.method, request.url.path, doing)
    return Response(status_code=CLIENT_CLOSED_REQUEST)


def error_response(status: int, message: str, category: str = "user", request: Request | None = None,
                   **extra) -> JSONResponse:
    """The Tinker error JSON; OpenAI's `{"error": {"message", "type", "code"}}` for the
    OpenAI-compatible routes under `/v1/` (their clients read only that shape)."""
    if request is not None and is_openai_path(request):
        from ember.server.openai_compat import error_body

        return JSONResponse(error_body(message, status), status_code=status)
    return JSONResponse({"error": message, "category": category, **extra}, status_code=status)


def is_openai_path(request: Request) -> bool:
    return request.scope.get("path", "").startswith("/v1/")


def _validation_message(errors: list[dict]) -> str:
    parts = []
    for err in errors[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')} (got {err.get('input')!r:.60})")
    more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(parts) + more


def _service_status(exc: ServiceError) -> int:
    if isinstance(exc, BusyError):
        return 429
    if isinstance(exc, NotFoundError):
        return 404
    if isinstance(exc, SessionGoneError):
        return 410
    if isinstance(exc, UserError):
        return 400
    return 500


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(AuthError)
    async def _auth(request: Request, exc: AuthError):
        return error_response(401, str(exc), request=request)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, exc: BodyTooLarge):
        return error_response(413, str(exc), request=request)

    @app.exception_handler(BodyTimeout)
    async def _body_timeout(_: Request, exc: BodyTimeout):
        response = error_response(408, str(exc))
        response.headers["connection"] = "close"  # the rest of the body will never be read
        return response

    @app.exception_handler(WireError)
    @app.exception_handler(BadRequest)
    async def _bad_request(request: Request, exc: ValueError):
        return error_response(400, str(exc), request=request)

    @app.exception_handler(pydantic.ValidationError)
    async def _invalid(request: Request, exc: pydantic.ValidationError):
        errors = exc.errors(include_url=False)
        if is_openai_path(request):  # OpenAI answers invalid requests with 400
            return error_response(400, _validation_message(errors), request=request)
        return error_response(422, _validation_message(errors), detail=_jsonable(errors))

    @app.exception_handler(RequestValidationError)
    async def _invalid_params(_: Request, exc: RequestValidationError):
        errors = list(exc.errors())
        return error_response(422, _validation_message(errors), detail=_jsonable(errors))

    @app.exception_handler(ClientDisconnect)
    async def _disconnected(request: Request, _: ClientDisconnect):
        # A client that hangs up mid-body is routine, not a server fault: one line, no traceback.
        return client_gone(request, "reading the request body")

    @app.exception_handler(ServiceError)
    async def _service(request: Request, exc: ServiceError):
        status = _service_status(exc)
        if isinstance(exc, BusyError):  # retried by the SDK after Retry-After
            response = error_response(status, str(exc), "server", request=request)
            response.headers["retry-after"] = str(exc.retry_after_s)
            return response
        return error_response(status, str(exc), "server" if status >= 500 else "user", request=request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if is_openai_path(request):
            return error_response(exc.status_code, str(exc.detail), request=request)
        return JSONResponse({"error": str(exc.detail), "category": "user"}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # The log keeps the traceback; the client gets the cause without SQL, paths or frames.
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, public_message(exc), "server", request=request)


def _jsonable(errors: list[dict]) -> list[dict]:
    return [{"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg")), "type": str(e.get("type"))}
            for e in errors]


__all__ = ["AuthError", "BadRequest", "client_gone", "error_response", "install_error_handlers", "is_openai_path"]
