"""The console's sign-in cookie, CSRF tokens and signing key (`ember.server.console.auth`)
and the chart geometry (`ember.server.console.svg`): pure, no server, no browser."""

from __future__ import annotations

import base64
import os
import stat

import pytest

from ember.server.console import auth
from ember.server.console.pages import local_path, location
from ember.server.console.svg import chart


def test_cookie_round_trip_and_refusals(tmp_path):
    secret = auth.load_secret(tmp_path)
    value, signin = auth.make_cookie(secret, "key-abc", 60, now=1000.0)
    assert auth.read_cookie(secret, value, now=1030.0) == signin
    assert auth.read_cookie(secret, value, now=1061.0) is None  # expired
    body, mac = value.split(".")
    # An attacker's body, encoded as the cookie's (URL-safe base64, unpadded), under the old MAC.
    forged_body = base64.urlsafe_b64encode(b'{"o": "key-other", "s": "x", "e": 9e9}').decode().rstrip("=")
    for bad in (f"{forged_body}.{mac}", f"{body}.{mac[:-2]}AA", value + "x" * 2000, "", "a.b.c", "nodot"):
        assert auth.read_cookie(secret, bad, now=1030.0) is None
    assert auth.read_cookie(os.urandom(32), value, now=1030.0) is None  # another server's secret


def test_csrf_token_bound_to_its_sign_in(tmp_path):
    secret = auth.load_secret(tmp_path)
    _, one = auth.make_cookie(secret, "key-abc", 60)
    _, two = auth.make_cookie(secret, "key-abc", 60)
    token = auth.csrf_token(secret, one)
    assert auth.csrf_ok(secret, one, token)
    assert not auth.csrf_ok(secret, two, token) and not auth.csrf_ok(secret, one, None)
    for hostile in ("\u202e", "é" * 43, "\udcff", "\x00"):  # a no, never a TypeError
        assert not auth.csrf_ok(secret, one, hostile)
        assert auth.read_cookie(secret, token[:10] + "." + hostile) is None


def test_secret_file_is_0600_stable_and_refused_when_readable_by_others(tmp_path):
    first = auth.load_secret(tmp_path)
    path = tmp_path / auth.SECRET_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(first) == 32
    assert auth.load_secret(tmp_path) == first  # sign-ins survive a restart
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        auth.load_secret(tmp_path)


@pytest.mark.parametrize("target,want", [("/training_runs", "/training_runs"), ("//evil.example", "/"),
                                         ("https://evil.example/", "/"), ("/\\evil", "/"), ("", "/"),
                                         ("/\t/evil.example", "/"), ("/a\r\nSet-Cookie: x=1", "/"),
                                         ("/a\x00b", "/"), ("/a\x85", "/"), ("/" + "x" * 5000, "/"),
                                         ("/training_runs/\u202eabc", "/training_runs/\u202eabc")])
def test_redirect_targets_stay_local(target, want):
    assert local_path(target) == want


@pytest.mark.parametrize("path,want", [
    ("/login?next=/training_runs/%E2%80%AE", "/login?next=/training_runs/%E2%80%AE"),  # encoded stays as is
    ("/training_runs/\u202eabc", "/training_runs/%E2%80%AEabc"), ("/a b\"<>", "/a%20b%22%3C%3E"),
    ("/a#b[c]", "/a%23b%5Bc%5D")])
def test_a_location_is_ascii_and_percent_encoded(path, want):
    assert location("", path) == want
    assert location("/prefix", path) == "/prefix" + want


def test_chart_places_points_and_breaks_at_missing_values():
    g = chart([(0, 1.0), (1, None), (2, 3.0), (3, 2.0)])
    assert [p.step for p in g.points] == [0, 1, 2, 3]
    assert len(g.segments) == 2  # the None splits the line
    ys = [p.y for p in g.points if p.y is not None]
    assert ys[1] < ys[2] < ys[0]  # larger value, higher on the page
    assert all(g.top <= y <= g.bottom for y in ys)
