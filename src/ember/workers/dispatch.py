"""Dispatch strategies: how one call on a group becomes one call per rank, and back.

* `all`: the same arguments on every rank; the answer is rank 0's (the ranks of an SPMD
  engine agree: optimizer steps, checkpoints, weights gathered with collectives).
* `mesh`: the first positional argument is a batch (datums, prompts). Items are split over
  the *data-parallel* ranks, balanced by token count; the tensor-parallel ranks of one
  data-parallel rank get the same items. Per-item outputs are put back in input order;
  metrics are reduced by their suffix (`:sum` summed, `:mean` weighted by each rank's item
  count, `:max`, `:min`; any other suffix keeps the first data-parallel rank's value).

Balance: longest-processing-time greedy (items by decreasing tokens, each to the rank with
the fewest tokens so far, ties to fewer items then lower rank). Its largest load is at
most `total/dp + longest item`, i.e. within one sequence of the optimum. Ranks may get
different item counts, even none (a batch smaller than `dp`): engines equalise the work
at the *micro-batch* level — every rank runs the same number of micro-batches, the
missing ones as zero-contribution padding (see `TorchEngine`'s parallel path) — which is
exact for every loss, unlike padding datums with zero weights (dro's quadratic term does
not vanish with zero advantages).
"""

from __future__ import annotations

import abc
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ember.metrics.keys import split_metric_key


@dataclass(frozen=True)
class RankLayout:
    """How an object's ranks map to data-parallel ranks (`tp` innermost, contiguous)."""

    world_size: int
    dp_size: int

    def __post_init__(self) -> None:
        if self.dp_size < 1 or self.world_size % self.dp_size:
            raise ValueError(f"dp_size={self.dp_size} must divide world_size={self.world_size}")

    @property
    def group_size(self) -> int:
        return self.world_size // self.dp_size

    def dp_rank(self, rank: int) -> int:
        return rank // self.group_size

    def leaders(self) -> list[int]:
        """The first rank of each data-parallel group (whose answers are kept)."""
        return [d * self.group_size for d in range(self.dp_size)]


@dataclass
class Plan:
    """What `scatter` decided, for `gather`."""

    assignment: list[list[int]] | None = None  # per dp rank: input indices, ascending
    num_items: int = 0


class Dispatch(abc.ABC):
    name: str = "dispatch"

    @abc.abstractmethod
    def scatter(self, args: tuple, kwargs: dict, layout: RankLayout) -> tuple[list[tuple[tuple, dict]], Plan]:
        """Per-rank (args, kwargs), in rank order, and the plan for `gather`."""

    @abc.abstractmethod
    def gather(self, results: list[Any], plan: Plan, layout: RankLayout) -> Any:
        """Combine the per-rank results (rank order) into the caller's answer."""


class AllDispatch(Dispatch):
    name = "all"

    def scatter(self, args, kwargs, layout):
        return [(args, kwargs)] * layout.world_size, Plan()

    def gather(self, results, plan, layout):
        return results[0]


# ---------------------------------------------------------------------- balancing
def item_tokens(item: Any) -> int:
    """Token count of a datum / ModelInput / anything with a `length` or `__len__`."""
    model_input = getattr(item, "model_input", None)
    if model_input is not None:
        try:
            return int(model_input.length)
        except ValueError:  # an image chunk without expected_tokens: its text, for balancing only
            return sum(int(getattr(c, "length", 0)) for c in model_input.chunks if hasattr(c, "tokens"))
    length = getattr(item, "length", None)
    if isinstance(length, int):
        return length
    try:
        return len(item)
    except TypeError:
        return 1


def balance(sizes: Sequence[int], bins: int) -> list[list[int]]:
    """LPT assignment of item indices to `bins` (each bin's indices ascending)."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    heap = [(0, 0, b) for b in range(bins)]  # (tokens, items, bin)
    out: list[list[int]] = [[] for _ in range(bins)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        tokens, count, b = heapq.heappop(heap)
        out[b].append(i)
        heapq.heappush(heap, (tokens + sizes[i], count + 1, b))
    return [sorted(b) for b in out]


# ---------------------------------------------------------------------- merging
def reduce_metrics(per_rank: Sequence[dict[str, float]], weights: Sequence[int]) -> dict[str, float]:
    """Merge metric dicts by key suffix; `:mean` is weighted by `weights` (items per rank)."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for m in per_rank for k in m):
        present = [(m[key], w) for m, w in zip(per_rank, weights) if key in m]
        values = [float(v) for v, _ in present]
        _, reduce = split_metric_key(key)
        if reduce == "sum":
            out[key] = sum(values)
        elif reduce == "max":
            out[key] = max(values)
        elif reduce == "min":
            out[key] = min(values)
        elif reduce == "mean":
            total = sum(w for _, w in present)
            out[key] = (sum(float(v) * w for v, w in present) / total) if total else sum(values) / len(values)
        else:
            out[key] = values[0]
    return out


def _reorder(parts: Sequence[Sequence[Any]], assignment: list[list[int]], n: int) -> list[Any]:
    out: list[Any] = [None] * n
    for indices, part in zip(assignment, parts):
        if len(part) != len(indices):
            raise RuntimeError(f"a rank returned {len(part)} outputs for {len(indices)} inputs")
        for i, value in zip(indices, part):
            out[i] = value
    return out


class MeshDispatch(Dispatch):
    name = "mesh"

    def scatter(self, args, kwargs, layout):
        if not args or not isinstance(args[0], Sequence):
            raise ValueError("mesh dispatch needs the batch (a list) as the first positional argument")
        batch = list(args[0])
        assignment = balance([item_tokens(x) for x in batch], layout.dp_size)
        per_rank = []
        for rank in range(layout.world_size):
            shard = [batch[i] for i in assignment[layout.dp_rank(rank)]]
            per_rank.append(((shard, *args[1:]), kwargs))
        return per_rank, Plan(assignment=assignment, num_items=len(batch))

    def gather(self, results, plan, layout):
        from tinker import types  # here: `ember.workers` loads without tinker (and torch)

        leaders = [results[r] for r in layout.leaders()]
        counts = [len(a) for a in plan.assignment]
        first = leaders[0]
        if isinstance(first, types.ForwardBackwardOutput):
            return types.ForwardBackwardOutput(
                loss_fn_output_type=first.loss_fn_output_type,
                loss_fn_outputs=_reorder([r.loss_fn_outputs for r in leaders], plan.assignment, plan.num_items),
                metrics=reduce_metrics([r.metrics for r in leaders], counts),
            )
        if isinstance(first, dict):
            return reduce_metrics(leaders, counts)
        if isinstance(first, (list, tuple)):
            return _reorder(leaders, plan.assignment, plan.num_items)
        raise TypeError(f"mesh dispatch cannot merge results of type {type(first).__name__}")


DISPATCHES: dict[str, Dispatch] = {"all": AllDispatch(), "mesh": MeshDispatch()}


def get_dispatch(dispatch: str | Dispatch) -> Dispatch:
    if isinstance(dispatch, Dispatch):
        return dispatch
    try:
        return DISPATCHES[dispatch]
    except KeyError:
        raise ValueError(f"unknown dispatch {dispatch!r}; expected one of {sorted(DISPATCHES)}") from None
