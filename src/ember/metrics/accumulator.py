"""Reducible metric statistics: the one data structure behind `record_metric`.

A metric key keeps (sum, count, min, max) instead of a list of values, so the four
reductions compose exactly across micro-batches (repeated `record` calls), ranks
(`all_reduce` of the four statistics, see `ember.metrics.distributed`) and steps
(`merge` of two accumulators): `mean` is sum/count over *all* recorded values, never a
mean of means.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

Reduction = Literal["mean", "sum", "min", "max"]
REDUCTIONS: tuple[str, ...] = get_args(Reduction)


def check_reduction(key: str, reduce: str) -> None:
    if reduce not in REDUCTIONS:
        raise ValueError(f"metric {key!r}: reduce must be one of {list(REDUCTIONS)}, got {reduce!r}")


def as_float(key: str, value: object) -> float:
    """A Python float from an int/float/0-d tensor/numpy scalar; anything else is a ValueError."""
    if isinstance(value, bool):
        return float(value)
    item = getattr(value, "item", None)
    if callable(item):
        numel = getattr(value, "numel", None) or getattr(value, "size", None)
        n = numel() if callable(numel) else numel
        if n not in (None, 1):
            raise ValueError(f"metric {key!r}: expected a scalar, got a tensor with {n} elements")
        value = item()
    if not isinstance(value, (int, float)):
        raise ValueError(f"metric {key!r}: expected a number, got {type(value).__name__} {value!r}")
    return float(value)


@dataclass
class Stat:
    """Running statistics of one key; the reduction says which one is reported."""

    reduce: str
    total: float = 0.0
    count: int = 0
    lo: float = math.inf
    hi: float = -math.inf

    def add(self, value: float, count: int = 1) -> None:
        self.total += value
        self.count += count
        self.lo = min(self.lo, value)
        self.hi = max(self.hi, value)

    def merge(self, other: Stat) -> None:
        self.total += other.total
        self.count += other.count
        self.lo = min(self.lo, other.lo)
        self.hi = max(self.hi, other.hi)

    def value(self) -> float:
        if self.reduce == "sum":
            return self.total
        if self.reduce == "mean":
            return self.total / self.count if self.count else math.nan
        if self.reduce == "min":
            return self.lo
        return self.hi


class MetricAccumulator:
    """Values recorded under string keys, each with a fixed reduction."""

    def __init__(self) -> None:
        self._stats: dict[str, Stat] = {}

    def record(self, key: str, value: object, reduce: str = "mean") -> None:
        check_reduction(key, reduce)
        stat = self._stat(key, reduce)
        stat.add(as_float(key, value))

    def _stat(self, key: str, reduce: str) -> Stat:
        stat = self._stats.get(key)
        if stat is None:
            stat = self._stats[key] = Stat(reduce)
        elif stat.reduce != reduce:
            raise ValueError(
                f"metric {key!r} was recorded with reduce={stat.reduce!r} and now with reduce={reduce!r}; "
                "one key has one reduction"
            )
        return stat

    def merge(self, other: MetricAccumulator) -> None:
        """Fold `other` in (e.g. several steps into one window); reductions must agree."""
        for key, stat in other._stats.items():
            self.merge_stat(key, stat)

    def merge_stat(self, key: str, stat: Stat) -> None:
        """Fold pre-reduced statistics of one key in (from another rank or step)."""
        check_reduction(key, stat.reduce)
        self._stat(key, stat.reduce).merge(stat)

    def stats(self) -> Mapping[str, Stat]:
        return self._stats

    def summary(self) -> dict[str, float]:
        return {key: stat.value() for key, stat in sorted(self._stats.items())}

    def clear(self) -> None:
        self._stats.clear()

    def __len__(self) -> int:
        return len(self._stats)

    def __contains__(self, key: object) -> bool:
        return key in self._stats
