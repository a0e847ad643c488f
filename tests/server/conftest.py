"""Fixtures for the server tests: one shared `ember serve` subprocess (session scope).

The fault-injection server (tests/server/fault_server.py) and the restart test start
their own servers with `helpers.server.start_server`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker

from helpers.server import API_KEY, ServerProc, start_server

# The session-wide servers hold every test module's sessions and runs under one API key
# (modules that talk raw HTTP never finish theirs): the per-key quotas, tested in
# test_server_quotas.py, are raised here so that the modules do not add up against them.
SHARED_QUOTAS = ["--limits.max_runs_per_key", "1000", "--limits.max_sessions_per_key", "10000",
                 "--limits.max_sampling_sessions_per_key", "10000"]


@pytest.fixture(scope="session")
def ember_server(tiny_model_dir, tmp_path_factory) -> Iterator[ServerProc]:
    """The shared plain `ember serve` (keys tml-test and tml-other, request log on)."""
    server = start_server(Path(tiny_model_dir), tmp_path_factory.mktemp("ember-serve"), extra_args=["--max-body-mb", "4", *SHARED_QUOTAS])
    yield server
    server.stop()
    assert server.proc.returncode in (0, -15), server.stderr_tail()


@pytest.fixture(scope="session")
def ember_server_postgres(tiny_model_dir, tmp_path_factory, postgres_server) -> Iterator[ServerProc]:
    """Like `ember_server`, with its database in the test session's PostgreSQL server."""
    url = postgres_server.create_database("ember_serve_shared")
    server = start_server(Path(tiny_model_dir), tmp_path_factory.mktemp("ember-serve-pg"),
                          extra_args=["--max-body-mb", "4", "--database-url", url, *SHARED_QUOTAS])
    yield server
    server.stop()
    assert server.proc.returncode in (0, -15), server.stderr_tail()


@pytest.fixture(params=["sqlite", "postgresql"])
def served(request) -> ServerProc:
    """The shared `ember serve` on SQLite, then the one on PostgreSQL."""
    return request.getfixturevalue("ember_server" if request.param == "sqlite" else "ember_server_postgres")


@pytest.fixture(scope="module")
def sc(ember_server):
    """An official SDK ServiceClient on the shared server (one session per test module)."""
    client = tinker.ServiceClient(base_url=ember_server.base_url, api_key=API_KEY)
    yield client
    client.close("success").result(timeout=30)
