"""Console sign-in: signed session cookies, CSRF tokens, the signing key (docs/architecture.md, "Console").

The cookie holds `{owner, sid, exp}` (the owner identity, never the API key), base64url
JSON plus an HMAC-SHA256 over it with the server's console secret: it cannot be forged
or altered without the secret, and it stops working at `exp`. `sid` is random per
sign-in; the CSRF token of every form is HMAC(secret, "csrf:" + sid), so a token is only
valid alongside its own cookie. The cookie is HttpOnly, SameSite=Strict, Path=/ (Secure
when the request came over https).

The secret is generated once per data directory (`<data_dir>/console-secret`, 32 random
bytes, created with mode 0600; a file readable by others is refused) so sign-ins survive
a restart; deleting the file signs everyone out.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COOKIE = "ember_console"
SECRET_FILE = "console-secret"
MAX_COOKIE_CHARS = 1024  # anything longer was not made here


@dataclass(frozen=True)
class Signin:
    owner: str
    sid: str
    expires: float


def load_secret(data_dir: Path) -> bytes:
    """The data directory's console secret, created (0600) on first use."""
    path = Path(data_dir) / SECRET_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"{path}: the console's signing key must be readable by its owner only "
                             f"(chmod 600), it has mode {stat.S_IMODE(mode):o}") from None
        secret = path.read_bytes()
        if len(secret) < 32:
            raise ValueError(f"{path}: expected at least 32 bytes of key, found {len(secret)}; delete it to "
                             "generate a new one (signs everyone out)") from None
        return secret
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    return path.read_bytes()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(secret: bytes, message: str) -> str:
    return _b64(hmac.new(secret, message.encode(), hashlib.sha256).digest())


def make_cookie(secret: bytes, owner: str, ttl_s: float, now: float | None = None) -> tuple[str, Signin]:
    signin = Signin(owner=owner, sid=secrets.token_urlsafe(16), expires=(now or time.time()) + ttl_s)
    body = _b64(json.dumps({"o": signin.owner, "s": signin.sid, "e": signin.expires}).encode())
    return f"{body}.{_mac(secret, 'cookie:' + body)}", signin


def read_cookie(secret: bytes, value: str | None, now: float | None = None) -> Signin | None:
    """The sign-in a cookie value carries; None for a missing, forged, altered or expired one."""
    if not value or len(value) > MAX_COOKIE_CHARS or value.count(".") != 1:
        return None
    body, mac = value.split(".")
    if not _same(mac, _mac(secret, "cookie:" + body)):
        return None
    try:
        data: Any = json.loads(_unb64(body))
        signin = Signin(owner=str(data["o"]), sid=str(data["s"]), expires=float(data["e"]))
    except (ValueError, KeyError, TypeError):
        return None
    return signin if signin.expires > (now or time.time()) else None


def csrf_token(secret: bytes, signin: Signin) -> str:
    return _mac(secret, "csrf:" + signin.sid)


def csrf_ok(secret: bytes, signin: Signin, token: str | None) -> bool:
    return bool(token) and _same(str(token), csrf_token(secret, signin))


def _same(given: str, expected: str) -> bool:
    """Constant-time equality of a value from a request and ours, compared as bytes:
    `hmac.compare_digest` raises TypeError for a str holding non-ASCII (a 500, not a no)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode())
