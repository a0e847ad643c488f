"""How `make test` hands test files to its pytest-xdist workers.

`--dist loadfile` gives a worker one test file at a time, so that a file's module-scoped
servers and models are made once. Session-scoped fixtures are made once per *worker*
instead, and four are expensive: tests/sampling/conftest.py's `vllm_sampler` (a vLLM
engine: ~25 s of CPU to start, most of it the engine core's imports), `pool_sampler` (two
replica processes), and tests/conftest.py's `ray_cluster` (a local Ray cluster, ~10 s) and
`two_hosts` (two network namespaces with a Ray node each, ~20 s). With files dealt out
freely, both workers ended up starting them. `SharedFixtureScheduling`
is loadfile with one change: the files that use one of those fixtures are one unit of
work, so one worker runs them all and starts the fixture once.

`check_units(items)` (called at collection) fails the run when a test that takes one of
these fixtures sits in a file outside its unit, so that the table cannot go stale silently.

Each of these fixtures registers how to stop it (`register_stop`); `stop_finished(item)`,
after each test's teardown, stops those whose last test in the collection (`LAST_USERS`,
from `last_users` at collection's end) was `item`. A worker runs its tests in collection
order (a unit's in one go), so nothing after that test takes the fixture: an idle vLLM
engine core burns ~4% of a core, and a Ray cluster's or two hosts' daemons more, for the
rest of the worker's run. A worker that never runs that test keeps the fixture to the end.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from xdist.scheduler import LoadFileScheduling

# unit name -> the files that share its session fixtures
UNITS: dict[str, tuple[str, ...]] = {
    "session samplers (vllm_sampler, pool_sampler)": (
        "tests/sampling/test_sampling_vllm.py",
        "tests/sampling/test_sampling_vllm_follow.py",
        "tests/sampling/test_sampling_lifecycle.py",
        "tests/sampling/test_sampling_exactness.py",
        "tests/sampling/test_sampling_pool.py",
        "tests/sampling/test_sampling_pool_follow.py",
        "tests/sampling/test_sampling_semantics.py",
        "tests/sampling/test_sampling_versions.py",
        "tests/sampling/test_sampling_params.py",
        "tests/sampling/test_sampling_prompt_extras.py",
        "tests/sampling/test_sampling_streaming.py",
    ),
    "a local Ray cluster (ray_cluster)": (
        "tests/engine/test_engine_parallel.py",
        "tests/engine/test_engine_parallel_cp.py",
        "tests/engine/test_engine_parallel_ep.py",
        "tests/sampling/test_sampling_pool_colocate.py",
        "tests/sampling/test_sampling_ray_replica.py",
    ),
    "two hosts with a Ray node each (two_hosts)": (
        "tests/server/test_server_two_hosts.py",
        "tests/workers/test_workers_two_hosts.py",
    ),
}
UNIT_OF = {path: unit for unit, paths in UNITS.items() for path in paths}
SHARED_FIXTURES = ("vllm_sampler", "pool_sampler", "ray_cluster", "two_hosts")  # `sampler`'s "vllm"/"pool" use the first two


class SharedFixtureScheduling(LoadFileScheduling):
    """`--dist loadfile`, but the files of a `UNITS` entry go to one worker as one unit."""

    def _split_scope(self, nodeid: str) -> str:  # the unit of work a test belongs to (xdist's seam)
        path = nodeid.split("::", 1)[0]
        return UNIT_OF.get(path, path)


def shared_fixtures(item: pytest.Item) -> set[str]:
    """The expensive session fixtures `item` uses (directly or as a `sampler` parameter)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    used = {name for name in SHARED_FIXTURES if name in item.fixturenames}
    if "sampler" in item.fixturenames and params.get("sampler") in ("vllm", "pool"):
        used.add(f"{params['sampler']}_sampler")
    return used


def check_units(items: Iterable[pytest.Item]) -> None:
    """Every test that uses a shared session fixture is in a file of `UNITS`."""
    stray = sorted({item.nodeid.split("::", 1)[0] for item in items
                    if shared_fixtures(item) and item.nodeid.split("::", 1)[0] not in UNIT_OF})
    if stray:
        raise pytest.UsageError(f"{stray} use {SHARED_FIXTURES}: add them to a unit in tests/helpers/scheduling.py "
                                "(one worker starts each shared fixture once)")


LAST_USERS = pytest.StashKey[dict]()  # fixture -> node id of its last test (`last_users`)
STOPS = pytest.StashKey[dict]()  # fixture -> how to stop it (`register_stop`)


def last_users(items: Iterable[pytest.Item]) -> dict[str, str]:
    """Each shared fixture -> the node id of the last test in `items` that takes it."""
    return {name: item.nodeid for item in items for name in shared_fixtures(item)}


def register_stop(config: pytest.Config, fixture: str, stop) -> None:
    """`fixture` (one of SHARED_FIXTURES) is stopped by `stop()` after its last test."""
    config.stash.setdefault(STOPS, {})[fixture] = stop


def stop_finished(item: pytest.Item) -> None:
    """After `item`'s teardown: stop the shared fixtures whose last test it was."""
    last = item.config.stash.get(LAST_USERS, {})
    for fixture, stop in item.config.stash.get(STOPS, {}).items():
        if last.get(fixture) == item.nodeid:
            stop()
