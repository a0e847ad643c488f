"""`ServerConfig`: the HTTP layer's own settings (the service has `ServiceConfig`)."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.config import meta

# What `/api/v1/client/config` answers (docs/protocol.md §1.4, recommended column).
# Every flag that would make the SDK call an endpoint we do not serve stays off.
DEFAULT_CLIENT_CONFIG: dict[str, Any] = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "parallel_fwdbwd_chunks": False,
    "fwdbwd_max_chunk_len": 1024,
    "fwdbwd_max_chunk_bytes_count": 5_000_000,
    "sample_no_retries": False,
    "sample_enable_stuck_detection": True,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}
DEFAULT_DYNAMIC_CONFIG: dict[str, Any] = {
    "refresh_interval_sec": 300,
    "sample_cancel_enabled": False,
    "sample_cancel_max_batch_size": 64,
}
# Flags that make the SDK call a route ember refuses (`ember.service.unsupported.UNSERVED_ROUTES`):
# (config, flag) -> the route. Turning one on would make every such call fail; refused at start-up.
UNSERVED_FLAGS: dict[tuple[str, str], str] = {
    ("client_config", "pjwt_auth_enabled"): "/api/v1/auth/token",
    ("client_config", "sample_use_retrieve_futures"): "/api/v1/retrieve_futures",
    ("client_config", "custom_loss_server_side"): "/api/v1/create_custom_loss",
    ("client_config", "sample_join_sampling_session"): "/api/v1/join_sampling_session",
    ("dynamic_config", "sample_cancel_enabled"): "/api/v1/cancel_future",
}
# The SDK's read timeout for one retrieve_future poll; a long-poll must end well before it.
SDK_RETRIEVE_TIMEOUT_S = 45.0


def key_identity(key: str) -> str:
    """Stable, non-secret owner id for an API key (what the database stores)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def short_key_id(key: str) -> str:
    """The label of a key's usage counters in /metrics and `ember admin usage`: the first
    8 hex digits of the key's sha256 (never the key; the owner id `key_identity` starts so too)."""
    return hashlib.sha256(key.encode()).hexdigest()[:8]


# The owner identity of `--admin-api-key` (its own tenant when it calls the ordinary API).
ADMIN_OWNER = "ember-admin"


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The API key a request presents: `X-API-Key` (the tinker SDK) or `Authorization:
    Bearer` (the `openai` client and most HTTP tools). `headers` is case-insensitive
    (starlette's `Headers`). The one place a key is read from a request."""
    key = headers.get("x-api-key")
    if key:
        return key
    scheme, _, token = (headers.get("authorization") or "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def load_api_keys_file(path: str | os.PathLike) -> dict[str, str]:
    """One key per line, optionally followed by an owner name: `tml-abc [alice]`.

    `#` starts a comment. Without a name the owner is `key_identity(key)`.
    """
    keys: dict[str, str] = {}
    for lineno, raw in enumerate(Path(path).read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) > 2:
            raise ValueError(f"{path}:{lineno}: expected 'KEY [OWNER]', got {len(parts)} fields")
        keys[parts[0]] = parts[1] if len(parts) == 2 else key_identity(parts[0])
    return keys


@dataclass
class ServerConfig:
    """Settings of the HTTP server.

    host: bind address; anything but loopback needs API keys.
    port: TCP port (0 = pick a free one; the line 'ember serve: listening on URL' on
        stdout says which).
    api_key: accepted API keys ('tml-...'), each its own owner (tenant).
    api_keys_file: file with one 'KEY [OWNER]' per line (`#` comments).
    api_keys: accepted key -> owner name (merged with the two above). All empty means
        "any `tml-` key, each its own tenant" and is only allowed on a loopback host.
    long_poll_s: how long `retrieve_future` holds a pending future before `try_again`
        (must stay well under the SDK's 45 s read timeout).
    inline_result_mb: a finished result larger than this, polled with `allow_metadata_only`
        (the SDK's first poll), is first answered with its size only (`complete_metadata`),
        so that the SDK reserves that much of its in-flight response memory before it polls
        for the bytes.
    max_body_mb: larger request bodies (also after zstd decompression) get HTTP 413.
    request_log: optional JSONL file with one short line per request (rotated by size).
    request_log_bodies: the request log also holds headers and small JSON bodies (debugging).
    path_prefix: serve under `/<prefix>/api/v1/...` (for a reverse proxy); "" = root.
    client_config / dynamic_config: overrides of `/api/v1/client/config` and its dynamic
        config (e.g. fwdbwd_max_chunk_len=256), merged over ember's defaults. A flag that
        would make the SDK call a route ember refuses (`UNSERVED_FLAGS`) cannot be turned on.
    metrics_auth: `GET /metrics` needs an accepted API key (X-API-Key or Authorization:
        Bearer). On by default because the metrics name every tenant's live runs; turn it
        off only where the port is reachable by the scraper alone.
    header_timeout_s: a request whose headers are not complete this long after its first
        byte (or after the connection opened) has its connection closed (slowloris).
    body_timeout_s / body_deadline_s: a request body that stalls this long between two
        chunks, or is not complete this long after the request arrived, gets 408 and the
        connection is closed. Only the wait for body bytes is bounded, never the answer
        (a `retrieve_future` long-poll holds its response as long as `long_poll_s`).
    console: serve the web console (runs, curves, checkpoints, a sampling playground) at
        the server's root, at Tinker's console paths (`/`, `/training_runs/...`, ...);
        sign in at `/login` with an API key.
    console_session_ttl_s: how long a console sign-in lasts (its signed, HttpOnly cookie
        expires then). The cookie's signing key is generated once per data directory
        (`<data_dir>/console-secret`, mode 0600).
    admin_api_key: the operator's key ('tml-...'): the only key the admin routes
        (`/api/v1/admin/...`, `ember admin`) and the console's operator page accept. It
        sees and ends every key's sessions and runs; never logged. Unset = no operator.
    max_requests_per_key: in-flight HTTP requests of one API key (owner) beyond this get
        429 with Retry-After. Above the SDK's own ceiling (a SamplingClient keeps up to
        2000 sample requests in flight, each one HTTP request at a time), so a normal
        training loop never meets it.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: list[str] = field(default_factory=list)
    api_keys_file: str | None = None
    api_keys: Mapping[str, str] = field(default_factory=dict)
    long_poll_s: float = 20.0
    inline_result_mb: float = 1.0
    max_body_mb: float = field(default=64.0, metadata=meta(limit=True))
    request_log: str | None = None
    request_log_bodies: bool = False
    path_prefix: str = ""
    client_config: Mapping[str, Any] = field(default_factory=dict)
    dynamic_config: Mapping[str, Any] = field(default_factory=dict)
    metrics_auth: bool = True
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    body_deadline_s: float = 600.0
    max_requests_per_key: int = field(default=4096, metadata=meta(limit=True))
    console: bool = True
    console_session_ttl_s: float = 12 * 3600.0
    admin_api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.long_poll_s <= SDK_RETRIEVE_TIMEOUT_S - 10:
            raise ValueError(
                f"ServerConfig.long_poll_s must be in (0, {SDK_RETRIEVE_TIMEOUT_S - 10}] "
                f"(the SDK gives up on a poll after {SDK_RETRIEVE_TIMEOUT_S} s), got {self.long_poll_s}"
            )
        if not self.inline_result_mb >= 0:
            raise ValueError(f"ServerConfig.inline_result_mb must be >= 0, got {self.inline_result_mb}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"ServerConfig.max_body_mb must be at least 1 KiB, got {self.max_body_mb}")
        for name in ("header_timeout_s", "body_timeout_s", "body_deadline_s", "console_session_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ServerConfig.{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_requests_per_key < 1:
            raise ValueError(f"ServerConfig.max_requests_per_key must be >= 1, got {self.max_requests_per_key}")
        self.api_keys = {**{k: key_identity(k) for k in self.api_key},
                         **(load_api_keys_file(self.api_keys_file) if self.api_keys_file else {}),
                         **dict(self.api_keys)}
        for key in self.api_keys:
            if not key.startswith("tml-"):
                raise ValueError(f"API key {key[:6]}...: the tinker SDK only sends keys starting with 'tml-'")
        self._check_admin_key()
        if not self.api_keys and not is_loopback(self.host):
            raise ValueError(f"refusing to serve on {self.host!r} without --api-key/--api-keys-file")
        prefix = self.path_prefix.strip("/")
        self.path_prefix = f"/{prefix}" if prefix else ""
        overridden = bool(self.client_config or self.dynamic_config)
        self.client_config = {**DEFAULT_CLIENT_CONFIG, **dict(self.client_config)}
        self.dynamic_config = {**DEFAULT_DYNAMIC_CONFIG, **dict(self.dynamic_config)}
        if overridden:  # ember's defaults are valid (a test checks them): no tinker (and torch) import for them
            check_client_configs(self.client_config, self.dynamic_config)
            for (table, flag), route in UNSERVED_FLAGS.items():
                if getattr(self, table).get(flag):
                    raise ValueError(f"{table}.{flag}: ember does not serve {route}, which the SDK calls when it is "
                                     "on; leave it false")

    def _check_admin_key(self) -> None:
        key = self.admin_api_key
        if key is None:
            return
        if not key.startswith("tml-") or len(key) < 12:
            raise ValueError("admin_api_key: expected a key starting with 'tml-' and at least 12 characters long")
        if key in self.api_keys:
            raise ValueError("admin_api_key: the operator's key must not also be an ordinary API key")

    def is_admin_key(self, key: str | None) -> bool:
        """Whether a presented key is `admin_api_key` (compared in constant time)."""
        return bool(key and self.admin_api_key) and hmac.compare_digest(key.encode(), self.admin_api_key.encode())

    @property
    def inline_result_bytes(self) -> int:
        return int(self.inline_result_mb * 1024 * 1024)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)

    def owner_for(self, key: str | None) -> str | None:
        """Owner identity for a presented key, or None if the key is not accepted."""
        if not key:
            return None
        if self.is_admin_key(key):
            return ADMIN_OWNER
        if self.api_keys:
            # compare every key in constant time rather than a dict lookup (no timing oracle)
            found = None
            for candidate, owner in self.api_keys.items():
                if hmac.compare_digest(candidate.encode(), key.encode()):
                    found = owner
            return found
        return key_identity(key) if key.startswith("tml-") else None


def check_client_configs(client_config: Mapping[str, Any], dynamic_config: Mapping[str, Any]) -> None:
    """Both answers validate as the SDK's response types (pydantic's ValidationError, a
    ValueError, naming the bad field otherwise)."""
    from tinker import types  # here, not at import: settings are checked before tinker loads torch

    types.ClientConfigResponse.model_validate(client_config)
    types.ClientDynamicConfigResponse.model_validate(dynamic_config)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
