"""Issue 43, item 2: hostile paths against every console route, signed in and not.

A real `ember serve` under the issue's 8 GB address-space cap (`prlimit --as`) is sent
every console route (GET and POST) with non-ASCII (U+202E), control characters, `%00`,
invalid percent-encodings, overlong paths and `//host` prefixes, in path segments and
query values, through a raw socket (so the request line is exactly what an attacker
writes). Every answer is below 500, every `Location` is ASCII, free of control characters
and same-origin, and the server logs no traceback.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import httpx
import pytest

from ember.server.console.routes import router
from helpers.server import API_KEY, ServerProc, memory_cap, start_server

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

MEMORY_CAP_BYTES = 8 * 1024**3  # the issue's `prlimit --as=8589934592`
HOSTILE = [
    "%E2%80%AE", "\u202e".encode().decode("latin-1"),  # U+202E percent-encoded, and raw UTF-8 bytes
    "%00", "a%00b", "%0D%0ASet-Cookie:%20x=1", "%09", "%7F", "%C2%85", "%1B%5B31m",
    "%ZZ", "%C0%AF", "%FF%FE", "%", "..%2F..%2Fetc%2Fpasswd", "%2F%2Fevil.example",
    "%5Cevil.example", "x" * 8000,
]
PREFIXES = ["//evil.example", "///evil.example", "/%2F%2Fevil.example", "/%5C%5Cevil.example", "/\\evil.example"]
NO_ANSWER = 599
GET_TEMPLATES = sorted({r.path for r in router.routes if "GET" in r.methods})
POST_TEMPLATES = sorted({r.path for r in router.routes if "POST" in r.methods})


def fill(template: str, value: str) -> str:
    return re.sub(r"\{[^}]+\}", value, template)


def targets(templates: list[str]) -> list[str]:
    """Each route with each hostile value in its path parameters and in a query value,
    then with a `//host` prefix."""
    out = []
    for template in templates:
        for value in HOSTILE:
            out.append(fill(template, value))
            out.append(fill(template, "x") + f"?next={value}&checkpoint={value}&mode={value}&offset={value}"
                       f"&metric={value}&base_model={value}")
        out.append(fill(template, "x") + "/" + "y" * 20000)  # an overlong path
        out += [prefix + fill(template, "x") for prefix in PREFIXES]
    return out


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[ServerProc]:
    proc = start_server(Path(tiny_model_dir), tmp_path_factory.mktemp("console-paths"),
                        wrap=memory_cap(MEMORY_CAP_BYTES))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def cookie(server) -> str:
    r = httpx.post(server.base_url + "/login", data={"api_key": API_KEY}, timeout=30)
    assert r.status_code == 303, r.text
    return r.headers["set-cookie"].split(";")[0]


def raw_request(port: int, method: str, target: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, dict]:
    """(status, lower-cased headers) of one request whose request line is `target` byte
    for byte (latin-1, so a raw UTF-8 sequence goes as its bytes)."""
    head = f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in {**headers, "Content-Length": str(len(body))}.items())
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head.encode("latin-1") + b"\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    lines = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    if not data:
        return NO_ANSWER, {}  # the connection closed unanswered: the server failed mid-response
    status = int(lines[0].split(" ")[1])
    return status, {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)}


def check_answer(server: ServerProc, method: str, target: str, status: int, headers: dict) -> list[str]:
    problems = []
    if status >= 500:
        problems.append(f"{method} {target[:120]!r} -> {status}")
    loc = headers.get("location")
    if loc is not None:
        resolved = urlsplit(urljoin(server.base_url + "/", loc))
        if not loc.isascii() or re.search(r"[\x00-\x20\x7f\\]", loc) or not loc.startswith("/") \
                or loc.startswith("//") or resolved.netloc != urlsplit(server.base_url).netloc:
            problems.append(f"{method} {target[:120]!r} -> Location {loc[:200]!r}")
    return problems


@pytest.mark.parametrize("signed_in", [False, True], ids=["anonymous", "signed-in"])
def test_every_console_route_with_hostile_paths(server, cookie, signed_in):
    headers = {"Cookie": cookie} if signed_in else {}
    problems = []
    for target in targets(GET_TEMPLATES):
        problems += check_answer(server, "GET", target, *raw_request(server.port, "GET", target, headers))
    form = {**headers, "Content-Type": "application/x-www-form-urlencoded"}
    for target in targets(POST_TEMPLATES):
        body = b"api_key=tml-nope&next=%2F%2Fevil.example&action=delete&csrf=%E2%80%AE&prompt=%E2%80%AE"
        problems += check_answer(server, "POST", target, *raw_request(server.port, "POST", target, form, body))
    assert not problems, "\n".join(problems[:40])
    assert "Traceback" not in server.stderr_path.read_text(), server.stderr_tail()
    assert not [e for e in server.requests() if e.get("status", 500) >= 500]


def test_the_issue_path_redirects_to_sign_in_with_the_path_encoded(server):
    """The issue's GET of /training_runs/%E2%80%AE... unsigned: a 303 to the sign-in page,
    the page it asked for carried percent-encoded in `next` (it was a 500)."""
    status, headers = raw_request(server.port, "GET", "/training_runs/%E2%80%AEabc", {})
    assert status == 303
    assert headers["location"] == "/login?next=/training_runs/%E2%80%AEabc"
    # signing in from there lands on the page asked for, still encoded and on this server
    r = httpx.post(server.base_url + "/login", data={"api_key": API_KEY, "next": "/training_runs/\u202eabc"},
                   timeout=30)
    assert r.status_code == 303 and r.headers["location"] == "/training_runs/%E2%80%AEabc"
