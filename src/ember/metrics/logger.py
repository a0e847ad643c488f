"""`MetricsLogger`: record values during a step, reduce them once per step, fan out to sinks.

    logger = MetricsLogger([ConsoleSink(), JsonlSink("run/metrics.jsonl")])
    with use_logger(logger):
        for step in range(n):
            for micro_batch in ...:
                record_metric("loss", loss, reduce="mean")     # reduced across micro-batches
                with span("forward_backward"): ...             # time/forward_backward, summed
            logger.flush(step)                                 # reduced (across ranks), written
    logger.window()                                            # reduced across all flushed steps

`record_metric` and `span` go to the logger installed with `use_logger` (or `set_logger`);
by default to a process-wide logger with no sinks. The logger is thread-safe; installing
one is process-wide, not per thread, so worker threads record into the same step.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping, Sequence

from ember.metrics.accumulator import MetricAccumulator
from ember.metrics.keys import split_metric_key
from ember.metrics.sinks import MetricSink


class MetricsLogger:
    """One step's accumulator, the run's accumulator, the sinks."""

    def __init__(self, sinks: Sequence[MetricSink] = (), sync_ranks: bool = False, group=None) -> None:
        self.sinks = list(sinks)
        self.sync_ranks, self.group = sync_ranks, group
        self._step = MetricAccumulator()
        self._window = MetricAccumulator()
        self._lock = threading.Lock()
        self._local = threading.local()  # per-thread key prefix stack
        self.history: list[tuple[int, dict[str, float]]] = []

    def record(self, key: str, value: object, reduce: str = "mean") -> None:
        key = "".join(getattr(self._local, "prefixes", ())) + key
        with self._lock:
            self._step.record(key, value, reduce)

    @contextlib.contextmanager
    def prefix(self, prefix: str) -> Iterator[None]:
        """Within the block (this thread), keys are recorded as `prefix + key`; nests."""
        stack = self._local.__dict__.setdefault("prefixes", [])
        stack.append(prefix)
        try:
            yield
        finally:
            stack.pop()

    def record_dict(self, metrics: Mapping[str, object], prefix: str = "") -> None:
        """Record Tinker-style metrics whose keys carry the reduction: {"loss:sum": 3.2}.

        Keys without a known `:reduction` suffix are recorded as means.
        """
        for key, value in metrics.items():
            name, reduce = split_metric_key(key)
            self.record(prefix + name, value, reduce or "mean")

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Time the block; its seconds are summed under `time/<name>` for this step."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(f"time/{name}", time.perf_counter() - start, reduce="sum")

    def pending(self) -> dict[str, float]:
        """What the current step has reduced so far (nothing is written)."""
        with self._lock:
            return self._step.summary()

    def flush(self, step: int) -> dict[str, float]:
        """Reduce this step's values (across ranks with `sync_ranks`), write them, start a new step."""
        with self._lock:
            acc, self._step = self._step, MetricAccumulator()
        if self.sync_ranks:
            from ember.metrics.distributed import all_reduce_metrics

            acc = all_reduce_metrics(acc, self.group)
        with self._lock:
            self._window.merge(acc)
        summary = acc.summary()
        self.history.append((step, summary))
        for sink in self.sinks:
            sink.write(step, summary)
        return summary

    def window(self, reset: bool = False) -> dict[str, float]:
        """Every value flushed so far (since the last reset), reduced across steps."""
        with self._lock:
            summary = self._window.summary()
            if reset:
                self._window = MetricAccumulator()
        return summary

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


_lock = threading.Lock()
_current = MetricsLogger()


def get_logger() -> MetricsLogger:
    return _current


def set_logger(logger: MetricsLogger) -> MetricsLogger:
    """Install `logger` process-wide; returns the previous one."""
    global _current
    with _lock:
        previous, _current = _current, logger
    return previous


@contextlib.contextmanager
def use_logger(logger: MetricsLogger) -> Iterator[MetricsLogger]:
    previous = set_logger(logger)
    try:
        yield logger
    finally:
        set_logger(previous)


def record_metric(key: str, value: object, reduce: str = "mean") -> None:
    """Record one value; values of a key are reduced with `reduce` when the step is flushed.

    reduce: "mean" | "sum" | "min" | "max" (fixed per key). Works the same across
    micro-batches (repeated calls), ranks (`MetricsLogger(sync_ranks=True)`) and steps
    (`MetricsLogger.window()`).
    """
    _current.record(key, value, reduce)


def span(name: str) -> contextlib.AbstractContextManager[None]:
    """Time a block into `time/<name>` (seconds, summed over the step)."""
    return _current.span(name)


def metric_prefix(prefix: str) -> contextlib.AbstractContextManager[None]:
    """Record keys as `prefix + key` within the block (e.g. "grpo/" for one phase of a run)."""
    return _current.prefix(prefix)
