"""`helpers.scheduling`: the files that share an expensive session fixture form one unit of
work for pytest-xdist, and a test using one outside its unit fails the collection."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from helpers.scheduling import (LAST_USERS, UNIT_OF, UNITS, SharedFixtureScheduling, check_units, last_users,
                                register_stop, stop_finished)


def item(nodeid: str, fixtures: tuple[str, ...], sampler: str | None = None):
    callspec = SimpleNamespace(params={"sampler": sampler}) if sampler else None
    return SimpleNamespace(nodeid=nodeid, fixturenames=list(fixtures), callspec=callspec)


def test_a_units_files_share_one_scope_and_other_files_keep_their_own():
    split = SharedFixtureScheduling._split_scope  # noqa: SLF001 (xdist's seam this class overrides)
    for unit, paths in UNITS.items():
        assert {split(None, f"{path}::test_x[vllm]") for path in paths} == {unit}
    assert split(None, "tests/engine/test_engine_losses.py::test_y") == "tests/engine/test_engine_losses.py"


def test_a_shared_fixture_outside_its_unit_fails_the_collection():
    inside = next(iter(UNIT_OF))
    check_units([item(f"{inside}::test_a[vllm]", ("sampler",), "vllm"),
                 item("tests/engine/test_engine_losses.py::test_b", ("tiny_model_dir",)),
                 item("tests/sampling/test_sampling_fairness.py::test_c[direct]", ("sampler",), "direct")])
    for stray in (item("tests/sampling/test_sampling_fairness.py::test_d[pool]", ("sampler",), "pool"),
                  item("tests/server/test_server_limits.py::test_e", ("vllm_sampler",))):
        with pytest.raises(pytest.UsageError, match=stray.nodeid.split("::")[0]):
            check_units([stray])


def test_a_shared_fixture_stops_after_its_last_test_in_the_collection():
    config = SimpleNamespace(stash=pytest.Stash())
    hosts, vllm = "tests/workers/test_workers_two_hosts.py", "tests/sampling/test_sampling_vllm.py"
    a, b = item(f"{hosts}::a", ("two_hosts",)), item(f"{vllm}::b[vllm]", ("sampler",), "vllm")
    c, d = item(f"{hosts}::c", ("two_hosts", "tmp_path")), item(f"{hosts}::d", ("tmp_path",))
    order = [a, b, c, d]
    config.stash[LAST_USERS] = last_users(order)
    assert config.stash[LAST_USERS] == {"two_hosts": c.nodeid, "vllm_sampler": b.nodeid}
    stops = []
    register_stop(config, "two_hosts", lambda: stops.append("two_hosts"))
    register_stop(config, "vllm_sampler", lambda: stops.append("vllm_sampler"))
    for done in order:  # each test's teardown, in order: not after `a` though `b` does not take it
        done.config = config
        stop_finished(done)
        stops.append(done.nodeid)
    assert stops == [a.nodeid, "vllm_sampler", b.nodeid, "two_hosts", c.nodeid, d.nodeid]
