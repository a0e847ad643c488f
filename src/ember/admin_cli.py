"""`ember admin`: the operator's view of a running `ember serve`, over HTTP with its
`--admin-api-key` (README "Operating ember"; the routes are `ember.server.routes_admin`).

    ember admin --url http://127.0.0.1:8000 sessions|runs|checkpoints|usage
    ember admin end-session SESSION_ID
    ember admin unload-run RUN_ID

The key comes from `--admin-api-key` or the environment variable EMBER_ADMIN_API_KEY
(better: it stays out of the shell history and the process list). `--json` prints the
server's answer as is. Standard library only: cheap to import, no SDK needed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote

KEY_ENV = "EMBER_ADMIN_API_KEY"
LISTINGS = ("sessions", "runs", "checkpoints", "usage")
# listing -> (column, header) pairs of its table
COLUMNS: dict[str, list[tuple[str, str]]] = {
    "sessions": [("session_id", "SESSION"), ("owner", "OWNER"), ("display_name", "NAME"),
                 ("heartbeat_age_s", "HEARTBEAT AGE S"), ("runs_loaded", "RUNS LOADED")],
    "runs": [("run_id", "RUN"), ("owner", "OWNER"), ("base_model", "BASE MODEL"), ("loaded", "LOADED"),
             ("steps", "STEPS"), ("failed", "FAILED")],
    "checkpoints": [("tinker_path", "CHECKPOINT"), ("owner", "OWNER"), ("checkpoint_type", "TYPE"),
                    ("size_bytes", "BYTES"), ("public", "PUBLIC")],
    "usage": [("key", "KEY"), ("owner", "OWNER"), ("sessions_active", "SESSIONS"), ("runs", "RUNS"),
              ("runs_loaded", "LOADED"), ("runs_created", "CREATED"), ("trained_tokens", "TRAINED TOKENS"),
              ("sampled_tokens", "SAMPLED TOKENS"), ("checkpoints", "CHECKPOINTS"),
              ("checkpoint_bytes", "CHECKPOINT BYTES")],
}


class AdminError(Exception):
    """The server refused, or could not be reached: the message says which and why."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    parser.add_argument("--admin-api-key", default=None, help=f"the server's --admin-api-key (default: ${KEY_ENV})")
    parser.add_argument("--json", action="store_true", help="print the server's JSON answer")
    parser.add_argument("action", choices=[*LISTINGS, "end-session", "unload-run"])
    parser.add_argument("id", nargs="?", help="the session (end-session) or training run (unload-run)")


def request(url: str, key: str, method: str, path: str, timeout_s: float = 60.0) -> Any:
    """The JSON answer of one admin route; AdminError with the server's reason otherwise."""
    req = urllib.request.Request(url.rstrip("/") + "/api/v1/admin" + path, method=method,
                                 headers={"X-API-Key": key, "Accept": "application/json"},
                                 data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            reason = json.loads(exc.read()).get("error")
        except ValueError:
            reason = None
        raise AdminError(f"{method} {path}: HTTP {exc.code}: {reason or exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise AdminError(f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from None


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """Rows as aligned text columns (a missing value is "-")."""
    cells = [[h for _, h in columns]] + [["-" if r.get(c) is None else str(r.get(c)) for c, _ in columns]
                                         for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells)


def run(args: argparse.Namespace) -> int:
    key = args.admin_api_key or os.environ.get(KEY_ENV)
    if not key:
        print(f"ember admin: no operator key: pass --admin-api-key or set {KEY_ENV}", file=sys.stderr)
        return 2
    if args.action in LISTINGS and args.id is not None or args.action not in LISTINGS and not args.id:
        print(f"ember admin {args.action}: " + ("takes no id" if args.action in LISTINGS else "needs an id"),
              file=sys.stderr)
        return 2
    try:
        if args.action == "end-session":
            answer = request(args.url, key, "POST", f"/sessions/{quote(args.id, safe='')}/end")
        elif args.action == "unload-run":
            answer = request(args.url, key, "POST", f"/training_runs/{quote(args.id, safe='')}/unload")
        else:
            answer = request(args.url, key, "GET", "/overview")
    except AdminError as exc:
        print(f"ember admin: {exc}", file=sys.stderr)
        return 1
    if args.json or args.action not in LISTINGS:
        print(json.dumps(answer if args.action not in LISTINGS else answer[args.action], indent=2))
    else:
        print(table(answer[args.action], COLUMNS[args.action]))
    return 0
