"""The `name:reduction` keys of Tinker results (`{"loss:sum": 3.2, "grad_norm:mean": 0.7}`):
built, read and repaired here, and nowhere else.

The SDK does `name, reduction = key.split(":")` on every forward_backward metric to merge
the chunks of one call, so a key on the wire has exactly one colon (`sdk_metric_key`).
"""

from __future__ import annotations

from ember.metrics.accumulator import REDUCTIONS


def join_metric_key(name: str, reduce: str) -> str:
    """The key of metric `name` reduced with `reduce`: `join_metric_key("loss", "sum") == "loss:sum"`."""
    return f"{name}:{reduce}"


def split_metric_key(key: str) -> tuple[str, str | None]:
    """(name, reduction) of a key that ends in a known `:reduction`; (key, None) otherwise
    (no colon, an empty name, or a suffix that is not one of REDUCTIONS)."""
    name, _, reduce = key.rpartition(":")
    if name and reduce in REDUCTIONS:
        return name, reduce
    return key, None


def sdk_metric_key(key: str) -> str:
    """A key the SDK can merge: exactly one colon, neither first nor last.

    Extra colons in the name become `_`; a key without a reduction gets `:sum` if it is
    "loss" (the one metric the SDK itself reads), else `:mean`."""
    if key.count(":") == 1 and not key.startswith(":") and not key.endswith(":"):
        return key
    name, _, reduce = key.rpartition(":")
    if not name or not reduce:
        base = key.replace(":", "_").strip("_") or "metric"
        return join_metric_key(base, "sum" if base == "loss" else "mean")
    return join_metric_key(name.replace(":", "_"), reduce)
