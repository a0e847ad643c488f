"""WorkerGroup over the inline and process runtimes: objects, calls, errors, mesh dispatch on
real ranks, and colocation (offload/onload round trips are bit-identical; only one
object's state is resident at a time)."""

import os
import pickle

import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.engine.parallel import ParallelismConfig
from helpers.datums import random_sft_datums
from ember.workers import EngineSpec, GroupEngine, WorkerGroup, make_runtime
from helpers import ranks as wt
from ember.workers.memory import state_bytes

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

CONFIG = EngineConfig(micro_batch_tokens=32)
ADAM = types.AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def procs():
    g = WorkerGroup.create("process", world_size=2, call_timeout_s=300)
    yield g
    g.shutdown()


def test_inline_group_objects_calls_and_errors():
    with WorkerGroup.create("inline") as g:
        g.build("c", wt.CounterFactory(start=5))
        assert g.call("c", "add", 2) == 7
        assert g.run(None, wt.rank_of) == 0 and g.run("c", wt.pid) == os.getpid()
        assert g.call("c", "echo", ["a", "b"], dispatch="mesh") == [(0, "a"), (0, "b")]
        with pytest.raises(ValueError, match="already exists"):
            g.build("c", wt.CounterFactory())
        with pytest.raises(KeyError, match="no object named 'nope'"):
            g.call("nope", "add", 1)
        with pytest.raises(ValueError, match="boom") as info:
            g.run(None, wt.fail_on_rank, 0, "boom")
        assert "raised on rank 0" in "".join(info.value.__notes__)
        assert g.call("c", "add", 1) == 8  # a user error leaves the group serving
    with pytest.raises(ValueError, match="exactly one rank"):
        make_runtime("inline", 2)
    with pytest.raises(ValueError, match="unknown runtime"):
        make_runtime("slurm", 1)


def test_inline_group_engine_is_the_bare_engine(tiny_model_dir):
    datums = random_sft_datums(5, vocab=84, seed=3)
    bare = TorchEngine.from_pretrained(tiny_model_dir, CONFIG)
    with WorkerGroup.create("inline") as g:
        eng = GroupEngine.create(g, "e", EngineSpec(str(tiny_model_dir), CONFIG))
        for _ in range(2):
            a, b = eng.forward_backward(datums, "cross_entropy"), bare.forward_backward(datums, "cross_entropy")
            assert a.metrics == b.metrics
            assert eng.optim_step(ADAM) == bare.optim_step(ADAM)
        for n, p in wt.full_params(bare).items():
            assert torch.equal(g.run("e", wt.full_params)[n], p), n
        with pytest.raises(ValueError, match=r"datum 1: .*target_tokens"):  # caller's index, before dispatch
            bad = random_sft_datums(2, vocab=84, seed=4)
            bad[1].loss_fn_inputs.pop("target_tokens")
            eng.forward_backward(bad, "cross_entropy")


def test_process_ranks_mesh_dispatch_in_input_order(procs):
    assert procs.ping() == [0, 1]
    assert len(set(procs.pids())) == 2
    procs.build("counter", wt.CounterFactory())
    try:
        for n in (1, 2, 3, 7):
            items = ["x" * (1 + (i * 37) % 11) for i in range(n)]  # skewed lengths
            out = procs.call("counter", "echo", items, dispatch="mesh")
            assert [item for _, item in out] == items
            ranks = {r for r, _ in out}
            assert ranks == ({0} if n == 1 else {0, 1})
            tokens = [sum(len(it) for r, it in out if r == k) for k in (0, 1)]
            assert max(tokens) - min(tokens) <= max(len(it) for it in items)
        assert procs.run_per_rank(None, wt.rank_of) == [0, 1]
        assert procs.call("counter", "add", 3) == 3  # all-dispatch: rank 0's answer
    finally:
        procs.remove("counter")


def test_process_rank_error_is_reraised_with_its_type_and_group_keeps_serving(procs):
    with pytest.raises(ValueError, match="only rank 1") as info:
        procs.run(None, wt.fail_on_rank, 1, "only rank 1 says no")
    assert "raised on rank 1" in "".join(info.value.__notes__)
    with pytest.raises((pickle.PicklingError, AttributeError)):  # nothing is sent unless every rank's request pickles
        procs.run(None, lambda ctx: ctx.rank)
    with pytest.raises(ValueError, match="rank 1 cannot build"):
        procs.build("half", wt.FailingFactory(rank=1))
    assert "half" not in procs.names
    procs.build("half", wt.CounterFactory())  # rank 0's partial build was removed
    procs.remove("half")
    assert procs.broken is None
    assert procs.ping() == [0, 1]


def test_engine_offload_onload_round_trip_is_bit_identical(tiny_model_dir):
    datums = random_sft_datums(4, vocab=84, seed=5)
    a = TorchEngine.from_pretrained(tiny_model_dir, CONFIG)
    b = TorchEngine.from_pretrained(tiny_model_dir, CONFIG)
    for step in range(3):
        a.forward_backward(datums, "cross_entropy")
        b.forward_backward(datums, "cross_entropy")
        if step == 1:  # with a gradient waiting and Adam state present
            b.offload()
            b.onload()
        a.optim_step(ADAM), b.optim_step(ADAM)
    for n, p in wt.full_params(a).items():
        assert torch.equal(wt.full_params(b)[n], p), n


def _train(engine: GroupEngine, datums, steps: int) -> None:
    for _ in range(steps):
        engine.forward_backward(datums, "cross_entropy")
        engine.optim_step(ADAM)


def test_colocated_engines_hold_one_state_at_a_time_and_train_bit_identically(tiny_model_dir, procs):
    """Two FSDP engines share the ranks: colocated, only the active one's state is resident.

    Measured: per rank, the peak over time of the state bytes (parameters, gradients, Adam
    moments; local shards) of the objects that are onloaded — see ember.workers.worker.
    """
    spec = EngineSpec(str(tiny_model_dir), CONFIG, ParallelismConfig(dp_shard=2))
    d1, d2 = random_sft_datums(4, vocab=84, seed=6), random_sft_datums(3, vocab=84, seed=7)
    alone = GroupEngine.create(procs, "alone", spec)  # reference: never offloaded
    _train(alone, d1, 2)
    expected = procs.run("alone", wt.full_params)
    alone.close()

    peaks = {}
    for colocate in (True, False):
        with WorkerGroup.create("process", world_size=2, colocate=colocate) as g:
            a, b = GroupEngine.create(g, "a", spec), GroupEngine.create(g, "b", spec)
            for _ in range(2):  # interleaved: when colocated, every switch offloads one and onloads the other
                _train(a, d1, 1)
                _train(b, d2, 1)
            got = g.run("a", wt.full_params)
            for n, p in expected.items():
                assert torch.equal(got[n], p), n
            a.forward_backward(d1, "cross_entropy")  # now each holds parameters + gradients + Adam state
            full = g.run("a", state_bytes)["total"]
            b.forward_backward(d2, "cross_entropy")
            assert g.run("b", state_bytes)["total"] == full
            mem = g.memory()
            assert [m["onloaded"] for m in mem] == ([["b"]] * 2 if colocate else [["a", "b"]] * 2)
            peaks[colocate] = [m["peak_tracked_bytes"] for m in mem]
    assert peaks[True] == [full, full]
    assert peaks[False] == [2 * full, 2 * full]
