"""Mesh dispatch: balance within one sequence of optimal, input order restored, metrics reduced."""

import itertools
import random

import pytest
import torch
from tinker import types

from helpers.datums import random_sft_datums
from ember.workers import MeshDispatch, RankLayout, balance, reduce_metrics
from ember.workers.dispatch import AllDispatch, get_dispatch, item_tokens


def optimal_makespan(sizes: list[int], bins: int) -> int:
    best = sum(sizes)
    for assignment in itertools.product(range(bins), repeat=len(sizes)):
        loads = [0] * bins
        for s, b in zip(sizes, assignment):
            loads[b] += s
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_balance_is_within_one_sequence_of_optimal(seed):
    rng = random.Random(seed)
    n, bins = rng.randint(1, 9), rng.choice([2, 3])
    # skewed: mostly short, sometimes very long
    sizes = [rng.choice([1, 2, 3, 50, 200]) if rng.random() < 0.3 else rng.randint(1, 8) for _ in range(n)]
    out = balance(sizes, bins)
    assert sorted(i for b in out for i in b) == list(range(n))  # a partition
    assert all(b == sorted(b) for b in out)  # input order kept inside a rank
    worst = max(sum(sizes[i] for i in b) for b in out)
    assert worst <= optimal_makespan(sizes, bins) + max(sizes)


def test_balance_spreads_equal_items_and_handles_fewer_items_than_ranks():
    assert balance([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]
    assert balance([7], 2) == [[0], []]
    assert balance([], 3) == [[], [], []]
    assert balance([100, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4]]
    with pytest.raises(ValueError, match="bins"):
        balance([1], 0)


def test_rank_layout_groups_tp_ranks_under_one_dp_rank():
    layout = RankLayout(world_size=4, dp_size=2)
    assert [layout.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert layout.leaders() == [0, 2]
    with pytest.raises(ValueError, match="must divide"):
        RankLayout(world_size=4, dp_size=3)


def fake_output(datums: list[types.Datum], rank: int) -> types.ForwardBackwardOutput:
    """What a rank would answer: per datum a marker of the datum, metrics of its share."""
    outs = [{"logprobs": types.TensorData.from_torch(torch.full((d.model_input.length,), float(rank)))} for d in datums]
    tokens = sum(d.model_input.length for d in datums)
    return types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord", loss_fn_outputs=outs,
        metrics={"loss:sum": float(tokens), "tok:max": float(tokens), "tok:min": float(tokens),
                 "rank:mean": float(rank), "tag:unique": 7.0},
    )


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_mesh_scatter_gather_restores_input_order_for_odd_and_skewed_batches(n):
    lengths = [1, 40, 2, 3, 90, 4, 5][:n]
    datums = [random_sft_datums(1, vocab=84, min_len=k, max_len=k, seed=i)[0] for i, k in enumerate(lengths)]
    layout = RankLayout(world_size=4, dp_size=2)  # tp=2: ranks 0,1 are dp 0; ranks 2,3 are dp 1
    mesh = MeshDispatch()
    per_rank, plan = mesh.scatter((datums, "cross_entropy"), {"x": 1}, layout)
    assert [a[1:] for a, _ in per_rank] == [("cross_entropy",)] * 4 and all(k == {"x": 1} for _, k in per_rank)
    assert per_rank[0][0][0] == per_rank[1][0][0] and per_rank[2][0][0] == per_rank[3][0][0]
    results = [fake_output(a[0], layout.dp_rank(r)) for r, (a, _) in enumerate(per_rank)]
    merged = mesh.gather(results, plan, layout)
    assert len(merged.loss_fn_outputs) == n
    for i, (d, out) in enumerate(zip(datums, merged.loss_fn_outputs)):
        got = out["logprobs"].to_torch()
        assert got.shape[0] == d.model_input.length, i  # datum i's own output, in place
        assert int(got[0]) == next(r for r, idx in enumerate(plan.assignment) if i in idx)
    total = sum(item_tokens(d) for d in datums)
    assert merged.metrics["loss:sum"] == total
    shares = [sum(item_tokens(datums[i]) for i in idx) for idx in plan.assignment]
    assert merged.metrics["tok:max"] == max(shares) and merged.metrics["tok:min"] == min(shares)
    counts = [len(idx) for idx in plan.assignment]
    assert merged.metrics["rank:mean"] == pytest.approx(counts[1] / sum(counts))  # weighted by datums
    assert merged.metrics["tag:unique"] == 7.0


def test_reduce_metrics_by_suffix_and_lists_reassembled():
    assert reduce_metrics([{"a:sum": 1, "b:mean": 2}, {"a:sum": 2, "b:mean": 5}], [1, 3]) == {"a:sum": 3, "b:mean": 4.25}
    assert reduce_metrics([{"b:mean": 2}, {"b:mean": 4}], [0, 0]) == {"b:mean": 3}
    mesh = MeshDispatch()
    layout = RankLayout(2, 2)
    per_rank, plan = mesh.scatter((["aaaa", "b", "cc", "d"],), {}, layout)
    merged = mesh.gather([[s.upper() for s in a[0]] for a, _ in per_rank], plan, layout)
    assert merged == ["AAAA", "B", "CC", "D"]


def test_all_dispatch_and_registry():
    per_rank, plan = AllDispatch().scatter((1, 2), {"k": 3}, RankLayout(3, 3))
    assert per_rank == [((1, 2), {"k": 3})] * 3
    assert AllDispatch().gather(["r0", "r1", "r2"], plan, RankLayout(3, 3)) == "r0"
    assert get_dispatch("mesh").name == "mesh"
    with pytest.raises(ValueError, match="unknown dispatch"):
        get_dispatch("scatter")
    with pytest.raises(ValueError, match="first positional argument"):
        MeshDispatch().scatter((), {}, RankLayout(2, 2))
