"""The service behaves the same on SQLite and PostgreSQL: over-long strings are the
caller's error on both (PostgreSQL enforces VARCHAR lengths, SQLite does not), and
concurrent writers (no global write lock on PostgreSQL) lose nothing."""

from __future__ import annotations

import threading

import pytest
from helpers.datums import random_sft_datums
from ember.service import UserError

from .conftest import new_run, result


@pytest.fixture
def svc(make_service, database_url):
    return make_service(database_url=database_url)


@pytest.mark.parametrize("field, limit", [("display_name", 256), ("project_id", 256), ("sdk_version", 64)])
def test_overlong_session_fields_are_user_errors(svc, field, limit):
    with pytest.raises(UserError, match=f"{field} is too long: {limit + 1} characters, at most {limit}"):
        svc.create_session("alice", **{field: "x" * (limit + 1)})
    ok = svc.create_session("alice", **{field: "x" * limit}).session_id  # at the limit: stored as given
    assert svc.list_sessions("alice").sessions == [ok]
    if field == "display_name":
        assert svc.get_session("alice", ok).display_name == "x" * limit


def test_overlong_model_id_is_a_user_error_and_the_service_keeps_serving(svc):
    with pytest.raises(UserError, match="model_id is too long"):
        svc.forward_backward("alice", "m" * 129, 1, random_sft_datums(1, 84, seed=1), "cross_entropy")
    _, model_id = new_run(svc)
    out = result(svc, "alice", svc.forward_backward("alice", model_id, 1, random_sft_datums(2, 84, seed=1),
                                                    "cross_entropy"))
    assert out.metrics["loss:sum"] > 0


def test_concurrent_writers_lose_nothing(svc):
    """8 threads create sessions and heartbeat them at once; every row is there after."""
    made: list[str] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(10):
                sid = svc.create_session("alice").session_id
                svc.heartbeat("alice", sid)
                made.append(sid)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sorted(svc.list_sessions("alice", limit=1000).sessions) == sorted(made) and len(made) == 80
