"""The FastAPI app: `create_app(service, config)`.

Routes only validate, translate and enqueue (no training logic): JSON bodies are parsed
with the SDK's own request types (`ember.server.requests`), protobuf with
`ember.server.wire`, and every call goes to the `ServiceAPI` with the caller's owner
identity (from the API key). Service calls run in the thread pool; `retrieve_future`
long-polls with `retrieve_async` on the event loop.
"""

from __future__ import annotations

import contextlib
import gc

from fastapi import FastAPI

from ember.server import (
    routes_admin, routes_external, routes_openai, routes_rest, routes_sampling, routes_session, routes_training,
    routes_unsupported,
)
from ember.server.request_guards import BodyTimeoutMiddleware, PerKeyLimitMiddleware
from ember.server.config import ServerConfig
from ember.server.errors import install_error_handlers
from ember.server.metrics import install_metrics
from ember.server.middleware import BodyLimitMiddleware, PathPrefixMiddleware, RequestLogMiddleware
from ember.service.api import ServiceAPI


def create_app(service: ServiceAPI, config: ServerConfig, *, close_service: bool = False) -> FastAPI:
    """The HTTP app over `service`. `close_service=True` closes the service at shutdown,
    saving its loaded runs first (a restart resumes them: README "Restarts")."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        # What startup made (modules, models: millions of objects) lives as long as the
        # server: frozen, a full garbage collection, which holds the interpreter lock and
        # so the event loop, no longer walks it (a big answer's allocations set one off).
        gc.freeze()
        try:
            yield
        finally:
            if close_service:
                service.close(save_runs=True)

    app = FastAPI(title="ember", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.state.config = config
    install_error_handlers(app)
    for module in (routes_unsupported, routes_session, routes_training, routes_external, routes_sampling,
                   routes_rest, routes_admin):
        app.include_router(module.router, prefix="/api/v1")
    app.include_router(routes_openai.router, prefix="/v1")  # OpenAI-compatible completions
    if config.console:
        from ember.server.console import install_console

        install_console(app)  # the web console at /, Tinker's console paths

    # add_middleware: the last added is the outermost.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    app.add_middleware(BodyTimeoutMiddleware, idle_s=config.body_timeout_s, deadline_s=config.body_deadline_s)
    app.add_middleware(PerKeyLimitMiddleware, config=config)
    install_metrics(app, service, require_key=config.metrics_auth)  # GET /metrics; inside the path prefix
    if config.path_prefix:
        app.add_middleware(PathPrefixMiddleware, prefix=config.path_prefix)
    if config.request_log:
        app.add_middleware(RequestLogMiddleware, path=config.request_log, bodies=config.request_log_bodies)
    return app
