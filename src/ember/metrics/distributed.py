"""Reduce a `MetricAccumulator` across the ranks of a torch.distributed group.

Each rank contributes its (sum, count, min, max) per key; the result on every rank is the
accumulator that one process would have built from all ranks' values. Keys recorded on
only some ranks are kept (the others contribute nothing); a key recorded with different
reductions on different ranks is a ValueError, as it is within one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ember.metrics.accumulator import MetricAccumulator, Stat


def _union_of_keys(acc: MetricAccumulator, group) -> dict[str, str]:
    local = {key: stat.reduce for key, stat in acc.stats().items()}
    gathered: list[dict[str, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    keys: dict[str, str] = {}
    for rank, part in enumerate(gathered):
        for key, reduce in (part or {}).items():
            if keys.setdefault(key, reduce) != reduce:
                raise ValueError(
                    f"metric {key!r}: rank {rank} records reduce={reduce!r}, another rank reduce={keys[key]!r}"
                )
    return dict(sorted(keys.items()))


def all_reduce_metrics(acc: MetricAccumulator, group=None) -> MetricAccumulator:
    """A new accumulator holding every rank's values (collective: all ranks must call it)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        out = MetricAccumulator()
        out.merge(acc)
        return out
    keys = _union_of_keys(acc, group)
    empty = Stat("sum")
    rows = [acc.stats().get(key, empty) for key in keys]
    # float64 keeps integer counts and sums exact far beyond what metrics need.
    sums = torch.tensor([[s.total, float(s.count)] for s in rows], dtype=torch.float64).reshape(-1, 2)
    los = torch.tensor([s.lo for s in rows], dtype=torch.float64)
    his = torch.tensor([s.hi for s in rows], dtype=torch.float64)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(los, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(his, op=dist.ReduceOp.MAX, group=group)
    out = MetricAccumulator()
    for i, (key, reduce) in enumerate(keys.items()):
        out.merge_stat(key, Stat(reduce, float(sums[i, 0]), int(sums[i, 1]), float(los[i]), float(his[i])))
    return out
