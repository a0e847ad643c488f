"""The web console of `ember serve`, at Tinker's console paths on the server's own address
(docs/architecture.md, "Console"): server-rendered pages (Jinja2, autoescaped), curves
drawn as SVG on the server, no JavaScript and nothing fetched from another origin.

    routes.py      the pages and their forms
    pages.py       rendering, security headers, sign-in state, form parsing, error pages
    auth.py        the signed session cookie, CSRF tokens, the signing key
    playground.py  sampling from a form
    svg.py         chart geometry
"""

from __future__ import annotations

from fastapi import FastAPI

from ember.server.console import pages
from ember.server.console.auth import load_secret


def install_console(app: FastAPI) -> None:
    """Mount the console on `app` (after the API routers: their paths are under /api/v1 and /v1)."""
    from ember.server.console.routes import router

    config, service = app.state.config, app.state.service
    data_dir = service.data_dir if service is not None else None
    app.state.console = pages.ConsoleState(data_dir=data_dir, session_ttl_s=config.console_session_ttl_s)
    if service is not None:
        load_secret(data_dir)  # at start-up: a bad key file stops `ember serve` with its reason
    app.include_router(router)
    app.add_exception_handler(pages.SignInRequired, pages.signin_redirect)
    app.add_exception_handler(pages.PageNotFound, pages.not_found_page)
    app.add_exception_handler(pages.PageError, pages.error_page)
