"""Rendering and request plumbing of the console: templates, security headers, sign-in
state, forms and the page-shaped errors (docs/architecture.md, "Console").

Every console response carries a Content-Security-Policy that allows nothing but this
origin's stylesheet (no script at all: the pages are plain forms), forbids framing, and
is not cached. Every POST must come from this origin (`Origin`, when the browser sends
one) and, once signed in, carry the sign-in's CSRF token.
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

from fastapi import Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader
from starlette.concurrency import run_in_threadpool

from ember.server.config import ADMIN_OWNER
from ember.server.console import auth
from ember.service.api import NotFoundError, SessionGoneError, UserError

CSP = ("default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; "
       "frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # no-referrer would make chromium send `Origin: null` on our own forms
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
}
MAX_FORM_BYTES = 64 * 1024  # the playground's prompt is the largest field
MAX_TARGET_CHARS = 2048  # a longer `next` was not made by a page of ours
# C0 and C1 controls (browsers drop tabs and newlines from a URL, so "/\t/host" would
# read as "//host"), and the backslash some browsers read as a slash
_UNSAFE_IN_TARGET = re.compile(r"[\x00-\x1f\x7f-\x9f\\]")
# what stays as is in a Location: RFC 3986's path and query characters; everything else
# (non-ASCII, controls, spaces, quotes) is percent-encoded, so the header is plain ASCII
LOCATION_SAFE = "/:@!$&'()*+,;=-._~?%"


class SignInRequired(Exception):
    """No valid sign-in cookie: redirect to /login."""


class PageNotFound(Exception):
    """Unknown, or another key's: the same 404 page either way."""


class PageError(Exception):
    """A request the page cannot serve (bad form, refused CSRF): a page with the reason."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class ConsoleState:
    """The console's settings; the signing key is read (or made) at its first use, so an
    app built without a service (route listings in tests) never touches a data directory."""

    data_dir: Path
    session_ttl_s: float
    _secret: bytes | None = None

    @property
    def secret(self) -> bytes:
        if self._secret is None:
            self._secret = auth.load_secret(self.data_dir)
        return self._secret


@functools.cache
def environment() -> Environment:
    env = Environment(loader=PackageLoader("ember.server.console"), autoescape=True, trim_blocks=True,
                      lstrip_blocks=True)
    env.filters["dt"] = lambda d: "—" if d is None else d.strftime("%Y-%m-%d %H:%M:%S UTC")
    env.filters["size"] = human_size
    env.filters["repr"] = lambda v: "" if v is None else repr(float(v))  # every digit: the tests read them back
    env.filters["ts"] = lambda t: "—" if t is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))
    return env


def human_size(n: int | None) -> str:
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def state(request: Request) -> ConsoleState:
    return request.app.state.console


def root(request: Request) -> str:
    """Where the console is mounted (`--path-prefix`), for links."""
    return request.scope.get("root_path", "").rstrip("/")


def secure(response: Response) -> Response:
    response.headers.update(SECURITY_HEADERS)
    return response


def signin_of(request: Request) -> auth.Signin | None:
    return auth.read_cookie(state(request).secret, request.cookies.get(auth.COOKIE))


def owner_of(request: Request) -> str:
    """The signed-in owner (a FastAPI dependency); SignInRequired otherwise."""
    signin = signin_of(request)
    if signin is None:
        raise SignInRequired()
    request.state.console_signin = signin
    return signin.owner


def render(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
    signin = getattr(request.state, "console_signin", None) or signin_of(request)
    csrf = auth.csrf_token(state(request).secret, signin) if signin else ""
    html = environment().get_template(template).render(root=root(request), signin=signin, csrf=csrf,
                                                       path=request.url.path, operator=is_operator(signin),
                                                       **context)
    return secure(HTMLResponse(html, status_code=status))


def is_operator(signin: auth.Signin | None) -> bool:
    """Signed in with the server's `--admin-api-key`: the operator's page and buttons."""
    return signin is not None and signin.owner == ADMIN_OWNER


def operator_of(request: Request) -> str:
    """A FastAPI dependency: the signed-in operator; the 403 page for any other sign-in."""
    owner = owner_of(request)
    if not is_operator(request.state.console_signin):
        raise PageError("the operator's page takes the server's --admin-api-key; sign in with it", 403)
    return owner


def redirect(request: Request, path: str) -> Response:
    """A 303 to `path` on this console (`location`: same origin, ASCII)."""
    return secure(RedirectResponse(location(root(request), local_path(path)), status_code=303))


async def call(fn, *args, **kwargs) -> Any:
    """A service call off the event loop; the service's NotFound is the 404 page, a user error the 400 page."""
    try:
        return await run_in_threadpool(fn, *args, **kwargs)
    except NotFoundError as exc:
        raise PageNotFound(str(exc)) from None
    except (UserError, SessionGoneError) as exc:
        raise PageError(str(exc)) from None


def check_origin(request: Request) -> None:
    """A POST from another site is refused (belt to the CSRF token's braces)."""
    origin = request.headers.get("origin")
    if origin is None:
        return
    if origin == "null" or urlsplit(origin).netloc != request.headers.get("host", ""):
        raise PageError("this form was posted from another site; refused", 403)


async def read_form(request: Request) -> dict[str, str]:
    """The urlencoded form (first value of each field), bounded; checks the origin."""
    check_origin(request)
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/x-www-form-urlencoded":
        raise PageError(f"expected a form post (application/x-www-form-urlencoded), got {ctype or 'no type'!r}")
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > MAX_FORM_BYTES:
            raise PageError(f"form too large: more than {MAX_FORM_BYTES} bytes", 413)
    try:
        fields = parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=64)
    except (UnicodeDecodeError, ValueError) as exc:
        raise PageError(f"unreadable form: {exc}") from None
    return {k: v[0] for k, v in fields.items()}


async def signed_form(request: Request) -> tuple[str, dict[str, str]]:
    """(owner, form) of a signed-in POST whose CSRF token is right; PageError 403 otherwise."""
    owner = owner_of(request)
    form = await read_form(request)
    if not auth.csrf_ok(state(request).secret, request.state.console_signin, form.get("csrf")):
        raise PageError("missing or wrong CSRF token: reload the page and try again", 403)
    return owner, form


def local_path(target: str | None) -> str:
    """A redirect target that stays on this server (no open redirect): a path starting
    with one "/", without control characters or backslashes, at most `MAX_TARGET_CHARS`;
    "/" for anything else."""
    if (not target or not target.startswith("/") or target.startswith("//") or len(target) > MAX_TARGET_CHARS
            or _UNSAFE_IN_TARGET.search(target)):
        return "/"
    return target


def location(root_path: str, path: str) -> str:
    """The `Location` of a redirect to `path` on the console mounted at `root_path`: every
    character outside `LOCATION_SAFE` percent-encoded (a header is latin-1 on the wire,
    and a control character in it would end the header)."""
    return quote(root_path + path, safe=LOCATION_SAFE)


async def not_found_page(request: Request, exc: PageNotFound) -> Response:
    return render(request, "error.html", 404, title="Not found",
                  message="Nothing here for this API key: " + str(exc))


async def error_page(request: Request, exc: PageError) -> Response:
    return render(request, "error.html", exc.status, title="Refused" if exc.status == 403 else "Error",
                  message=str(exc))


async def signin_redirect(request: Request, exc: SignInRequired) -> Response:
    """To /login, with `next=` the page asked for (a GET of a local path only), the
    path percent-encoded whole so that it is one query value."""
    target = local_path(request.url.path)
    if target == "/" or request.method != "GET":
        return redirect(request, "/login")
    return redirect(request, "/login?next=" + quote(target, safe="/"))
