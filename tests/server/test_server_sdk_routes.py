"""Every path the installed SDK can call is served or refused with a reason naming the call:
none reaches the generic `{"error": "Not Found"}` (or 405) of an unknown route.

The routes are read from the SDK's source (every `client.get/post/put/delete("/api/v1/...")`
and `_request("GET", "/api/v1/...")` call), not from a hand-written list, so a route a new
SDK adds fails here until ember answers it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tinker
from fastapi.testclient import TestClient

from ember.server.app import create_app
from ember.server.config import ServerConfig
from ember.server.routes_unsupported import ENDPOINTS
from ember.service import Service, ServiceConfig
from helpers.server import API_KEY

VERBS = {"get", "post", "put", "delete", "patch"}
GENERIC = ({"error": "Not Found", "category": "user"}, {"error": "Method Not Allowed", "category": "user"})


def _path_of(node: ast.expr) -> str | None:
    """The literal path of a call's argument; each f-string field becomes "x"."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "x" for v in node.values)
    return None


def _route_of(call: ast.Call) -> tuple[str, str] | None:
    func = call.func
    name = (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")).lstrip("_")
    args = list(call.args)
    if name == "request" and len(args) >= 2 and isinstance(args[0], ast.Constant):
        name, args = str(args[0].value).lower(), args[1:]
    path = _path_of(args[0]) if name in VERBS and args else None
    return (name.upper(), path) if path and path.startswith("/api/v1/") else None


def sdk_routes() -> set[tuple[str, str]]:
    """(HTTP method, path) of every route the installed `tinker` package calls (its tests left out)."""
    root = Path(tinker.__file__).parent
    found = set()
    for source in root.rglob("*.py"):
        if source.name.endswith("_test.py"):
            continue
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Call) and (route := _route_of(node)):
                found.add(route)
    return found


ROUTES = sorted(sdk_routes())


def test_the_sdk_source_yields_its_routes():
    """The walk finds the routes every client uses (else the test below proves nothing)."""
    assert len(ROUTES) >= 40
    for route in [("POST", "/api/v1/asample"), ("POST", "/api/v1/retrieve_future"), ("POST", "/api/v1/copy_weights"),
                  ("GET", "/api/v1/training_runs/x/checkpoints/x/external_weights_urls"),
                  ("DELETE", "/api/v1/auth/apikey/me"), ("POST", "/api/v1/cancel_future")]:
        assert route in ROUTES


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    service = Service(ServiceConfig(data_dir=tmp_path_factory.mktemp("routes")))
    with TestClient(create_app(service, ServerConfig(api_keys={API_KEY: "alice"}), close_service=True)) as client:
        yield client


@pytest.mark.parametrize("method,path", ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_no_sdk_route_reaches_the_generic_not_found(http, method, path):
    body = {} if method in ("POST", "PUT") else None
    resp = http.request(method, path, json=body, headers={"X-API-Key": API_KEY})
    answer = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else None
    assert answer not in GENERIC, f"{method} {path}: {resp.status_code} {answer}"
    assert resp.status_code not in (405, 500), f"{method} {path}: {resp.status_code} {resp.text[:200]}"


REFUSED = [(verb, f"/api/v1{path}".replace("{session_id}", "x"), name) for verb, path, name in ENDPOINTS]


@pytest.mark.parametrize("method,path,name", REFUSED, ids=[name for _, _, name in REFUSED])
def test_a_refused_call_answers_tinkers_error_shape_naming_the_call(http, method, path, name):
    resp = http.request(method, path, json={} if method in ("POST", "PUT") else None, headers={"X-API-Key": API_KEY})
    assert resp.status_code == 404
    body = resp.json()
    assert body["category"] == "user" and body["error"].startswith(f"{name} is not supported by ember: ")
    assert (method, path) in ROUTES  # each refusal is of a route the SDK calls


def test_a_refusal_needs_a_key(http):
    assert http.post("/api/v1/copy_weights", json={}).status_code == 401


def test_the_flags_ember_keeps_off_are_those_of_the_routes_it_refuses():
    from ember.server.config import UNSERVED_FLAGS

    refused = {f"/api/v1{path}" for _, path, _ in ENDPOINTS}
    assert set(UNSERVED_FLAGS.values()) <= refused
