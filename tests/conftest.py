"""Shared fixtures: tiny models built in code and loaded back through `from_pretrained`."""

from __future__ import annotations

import atexit
import gc
import os
import re
from pathlib import Path

# `helpers` for the processes the tests start too (`ember serve`, worker ranks, Ray actors):
# functions sent to a rank are pickled by reference and imported there.
_TESTS = str(Path(__file__).resolve().parent)
os.environ["PYTHONPATH"] = os.pathsep.join([_TESTS, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TINKER_TELEMETRY", "0")
# One OpenMP thread in the processes the tests start too (servers, vLLM engine cores), as
# torch.set_num_threads(1) below does in this one: see the comment there.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest


def pytest_configure(config):
    """One intra-op thread: the suite starts servers and worker processes beside pytest, and
    oversubscribed threads slow tiny-model ops by orders of magnitude on a 2-core machine.
    Not in the xdist controller, which runs no test: importing torch there costs every run
    ~2 s of CPU before the workers start."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    gc.disable()  # until collection is done (pytest_collection_finish): see there
    import torch

    torch.set_num_threads(1)


# The files that each hold an xdist worker for minutes under `make test` (a server and
# several recipe subprocesses, or a vLLM engine and a training run). They are scheduled
# first (the Makefile passes --no-loadscope-reorder, so xdist keeps this order instead of
# ordering files by their number of tests, which put the cookbook's 7 long tests last) and
# the many short files fill in behind them: no worker ends the run alone on one of them.
HEAVY_FIRST = (  # longest first, from a full run's --durations (per-file sums); a unit's files together
    # the longest file (two world-2 compiled layouts), beside the Ray unit on the other worker
    "tests/engine/test_engine_compile.py",
    # the unit "a local Ray cluster" (helpers.scheduling), its Ray cases back to back
    "tests/sampling/test_sampling_pool_colocate.py",
    "tests/sampling/test_sampling_ray_replica.py",
    "tests/engine/test_engine_parallel.py",
    "tests/engine/test_engine_parallel_cp.py",
    # the unit "session samplers"
    "tests/sampling/test_sampling_vllm.py",
    "tests/sampling/test_sampling_lifecycle.py",
    "tests/sampling/test_sampling_pool.py",
    "tests/sampling/test_sampling_exactness.py",
    "tests/sampling/test_sampling_semantics.py",
    "tests/sampling/test_sampling_versions.py",
    "tests/sampling/test_sampling_params.py",
    "tests/sampling/test_sampling_prompt_extras.py",
    # files
    "tests/recipes/test_recipes_vllm.py",
    # the unit "two hosts"
    "tests/server/test_server_two_hosts.py",
    "tests/workers/test_workers_two_hosts.py",
    # files
    "tests/server/test_server_restart_signals.py",
    "tests/recipes/test_recipes_cookbook_moe.py",
    "tests/engine/test_engine_parallel_ep.py",
    "tests/server/test_server_console_ops.py",
    "tests/server/test_server_admin.py",
    "tests/server/test_server_sdk_routing_replay.py",
    "tests/server/test_server_fuzz.py",
    "tests/sampling/test_sampling_vllm_exit.py",
    "tests/sampling/test_sampling_vllm_weight_sync.py",
    "tests/sampling/test_sampling_weight_sync.py",
    "tests/recipes/test_recipes_cookbook.py",
    "tests/test_readme.py",
    "tests/engine/test_engine_estimate.py",
    "tests/server/test_server_sdk_vllm.py",
    "tests/server/test_server_tenants_sampling.py",
    "tests/server/test_server_sampler_pool.py",
    "tests/engine/test_engine_chunked_memory.py",
    "tests/server/test_server_faults.py",
    "tests/models/test_models_olmo2.py",
    "tests/recipes/test_recipes_grpo_resume.py",
    "tests/server/test_server_crash_checkpoints.py",
    "tests/server/test_server_sdk_checkpoint_lifecycle.py",
    "tests/recipes/test_recipes_ppo.py",
    "tests/engine/test_engine_parallel_2d.py",
    "tests/recipes/test_recipes_demo.py",
    "tests/recipes/test_recipes_vlm_sft.py",
    "tests/server/test_server_external_weights.py",
    "tests/engine/test_engine_parallel_vocab.py",
    "tests/service/test_service_restart.py",
    "tests/server/test_server_slow_clients.py",
    "tests/server/test_server_fault_futures.py",
)


def heavy_first(items) -> None:
    """Reorder `items` in place: HEAVY_FIRST's files in that order, then the rest as collected."""
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable


# A test file that is `slow` as a whole: its first statement of the kind is `pytestmark = pytest.mark.slow`
# or a list that starts with it.
SLOW_FILE = re.compile(r"^pytestmark = \[?pytest\.mark\.slow\b", re.MULTILINE)


def pytest_ignore_collect(collection_path, config):
    """Under `-m "not slow"` (`make test-fast`) a file that is slow as a whole is not imported:
    all its tests would be deselected, after seconds of imports (openai, schemathesis, ray) in
    every xdist worker."""
    if config.option.markexpr.strip() != "not slow" or collection_path.suffix != ".py" \
            or not collection_path.name.startswith("test_"):
        return None
    return True if SLOW_FILE.search(collection_path.read_text()) else None


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` keeps the files sharing an expensive session fixture on one worker."""
    if config.getvalue("dist") == "loadfile":
        from helpers.scheduling import SharedFixtureScheduling

        return SharedFixtureScheduling(config, log)
    return None


def pytest_collection_finish(session):
    """Move everything collecting made (torch, transformers and every test module: millions
    of objects that live until the end) out of the garbage collector's view: each full
    collection during the tests, and pytest's at the end, then traverses only what the tests
    made (~1 s less per full collection in a worker). `atexit` gives them back, so that the
    interpreter's last collection still finalizes them. The collector is off while
    collecting (pytest_configure): imports make long-lived objects, not garbage, and its
    full passes over them cost a worker ~2 s."""
    from helpers.scheduling import LAST_USERS, last_users

    session.config.stash[LAST_USERS] = last_users(session.items)
    gc.freeze()
    gc.enable()
    atexit.register(gc.unfreeze)


def pytest_collection_modifyitems(config, items):
    from helpers.scheduling import check_units

    check_units(items)
    heavy_first(items)
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none (CPU-only CI)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `"gpu" in item.keywords`: that holds in a folder named gpu
            item.add_marker(skip)


def pytest_runtest_setup(item):
    """`needs_vllm`: asked when the test is about to run, so that collecting (and `make
    test-fast`, which runs none of them) never imports vLLM."""
    if item.get_closest_marker("needs_vllm") is not None:
        from ember.sampling.registry import backend_missing

        reason = backend_missing("vllm")
        if reason is not None:
            pytest.skip(reason=reason)


@pytest.fixture(scope="session")
def ray_cluster(request):
    """This worker's local Ray cluster, started by the first test that calls `start()`
    (helpers.ray_local); the files that take it form one xdist unit (helpers.scheduling)."""
    from helpers.ray_local import LocalRay
    from helpers.scheduling import register_stop

    cluster = LocalRay()
    register_stop(request.config, "ray_cluster", cluster.stop)
    yield cluster
    cluster.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the fixtures' own teardown (the files' actors and pools are gone by then): the
    shared session fixtures whose last test this was stop (helpers.scheduling)."""
    yield
    from helpers.scheduling import stop_finished

    stop_finished(item)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Qwen3 (hidden 64, 2 layers, head_dim 16) with a char tokenizer, on disk."""
    from ember.models.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), family="qwen3", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny Llama with the same shape as `tiny_model_dir`."""
    from ember.models.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), family="llama", seed=1)


@pytest.fixture(scope="session")
def tiny_vllm_model_dir(tmp_path_factory):
    """`tiny_model_dir`'s shape with head_dim 32, the smallest head vLLM's CPU attention
    supports: the model every sampler backend is tested on."""
    from ember.models.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-hd32"), family="qwen3", seed=0, head_dim=32)


# gpt-oss's cases are `slow`: `make test-fast` keeps Qwen3-MoE's, and gpt-oss's own
# behaviour (packed masks, harmony tokenizer) in tests that build their own model
MOE_FAMILIES = ("qwen3_moe", pytest.param("gpt_oss", marks=pytest.mark.slow))


@pytest.fixture(scope="session", params=MOE_FAMILIES)
def tiny_moe_dir(request, tmp_path_factory):
    """A tiny mixture-of-experts model of each family (hidden 64, 2 layers, 2 heads of 32,
    4 experts, 2 per token) with the char tokenizer; the hub's per-expert layout for
    Qwen3-MoE (transformers' `save_pretrained` writes it), fused for gpt-oss."""
    from ember.models.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), family=request.param, seed=0,
                            num_heads=2, num_kv_heads=2, head_dim=32)


# ---------------------------------------------------------------- databases
# One PostgreSQL server per test session (started on first use), one fresh database per
# test in it; SQLite is a fresh file. Tests that take `database_url` run on both.


@pytest.fixture(scope="session")
def postgres_server():
    from helpers.postgres import PostgresServer, find_bindir

    bindir = find_bindir()
    if bindir is None:
        pytest.skip(reason="PostgreSQL is not installed (no pg_ctl on PATH nor /usr/lib/postgresql/*/bin): "
                           "apt-get install postgresql (.ci/run does)")
    try:
        import psycopg  # noqa: F401
    except ImportError as exc:
        pytest.skip(reason=f"psycopg is not importable ({exc}): pip install 'ember[postgres]'")
    server = PostgresServer.start(bindir)
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)])
def database_url(request, tmp_path_factory):
    """A SQLAlchemy URL of a new, empty database. The PostgreSQL cases are `slow` (a server
    start per xdist worker): `make test-fast` runs the database tests on SQLite."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'ember.db'}"
        return
    import uuid

    server = request.getfixturevalue("postgres_server")
    name = f"t_{uuid.uuid4().hex[:16]}"
    yield server.create_database(name)
    server.drop_database(name)


# ---------------------------------------------------------------- two hosts
@pytest.fixture(scope="session")
def two_hosts_pair(request):
    """The session's `helpers.netns.SharedTwoHosts` (started by `two_hosts`); always torn down."""
    from helpers.netns import SharedTwoHosts
    from helpers.scheduling import register_stop

    shared = SharedTwoHosts()
    register_stop(request.config, "two_hosts", shared.stop)
    yield shared
    shared.stop()


@pytest.fixture(scope="module")
def two_hosts(two_hosts_pair):
    """Two network namespaces joined by a veth pair, a Ray node in each (helpers.netns), shared
    by the files of one xdist unit (helpers.scheduling) and stopped after the last test that
    takes it, pass or fail. Skips, saying why, where namespaces cannot be made."""
    from helpers.netns import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason=reason)
    return two_hosts_pair.start()
