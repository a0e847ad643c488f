"""`helpers.scheduling`: the files that share an expensive session fixture form one unit of
work for pytest-xdist, and a test using one outside its unit fails the collection."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from helpers.scheduling import UNIT_OF, UNITS, SharedFixtureScheduling, check_units, stop_after


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


def test_a_shared_fixture_stops_after_the_last_test_of_a_run_that_takes_it():
    stops = []
    a, b = item("tests/x.py::a", ("two_hosts",)), item("tests/x.py::b", ("two_hosts", "tmp_path"))
    other = item("tests/x.py::c", ("tmp_path",))
    for current, nxt in ((a, b), (other, a), (b, other), (a, None)):
        stop_after(current, nxt, "two_hosts", lambda: stops.append(current.nodeid))
    assert stops == ["tests/x.py::b", "tests/x.py::a"]  # not while the next test takes it, nor by a test without it
