"""Per-step metric history of training runs: what the console draws as curves.

Every `forward_backward`, `forward` and `optim_step` result of a run is one `run_metrics`
row (`MetricRow`): the op's kind, its metrics (the dict the client received, plus the
server's count of the op's target tokens as `target_tokens:sum`), and the run's step =
the SDK's step before the op: how many optimizer steps the client has seen
(`optim_step`'s `step:max` counts on from a checkpoint loaded with its optimizer), not
this lifetime's count. Samples of the run's own samplers (same session) since its last
step are added to its next `optim_step` row (`sampled_tokens:sum`, `sampled_sequences:sum`,
`completion_length:mean`: kept in memory until then, no write on the sampling path).
`derived` turns these into the per-step series the console draws beside the client's
metrics: tokens trained, trained tokens per second, tokens sampled, mean completion length. The row is written on
the run's lane, after the op and before its future completes: the training path pays
exactly one INSERT (measured by `benchmarks/http_overhead.py`, `metrics_history_overhead`),
and a restart keeps what was written.

Bound: at most `ServiceConfig.metric_history_rows` rows per run. When a run reaches it, a
background thread *thins* the older half: among the oldest half of the run's distinct
steps, every second step's rows are deleted (all kinds of that step together, so the
curves stay aligned). The newest half keeps full resolution; each thinning halves the
density of what is older, so a long run keeps its whole span at a resolution that falls
off with age instead of losing its beginning. Only when the thinner falls far behind
(2x the bound) does the lane thin inline. 0 = nothing is recorded.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ember.service.clock import SYSTEM_CLOCK, Clock
from ember.service.faults import public_message
from ember.service.store import Store

log = logging.getLogger(__name__)

KINDS = ("forward_backward", "forward", "optim_step")
TOKENS = "target_tokens:sum"  # the server's count of an op's target tokens, added to its row
SAMPLED, SEQUENCES, COMPLETION = "sampled_tokens:sum", "sampled_sequences:sum", "completion_length:mean"
SDK_STEP = "step:max"  # optim_step's own count of optimizer steps (the engine's, saved with its optimizer)
MAX_METRICS_PER_ROW = 256  # a result's metrics dict is the engine's own, but bound what one row holds


def clean_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float | None]:
    """JSON-safe metrics: names as strings, values as floats, non-finite ones as None
    (PostgreSQL's JSON has no NaN; the console draws None as a gap)."""
    out: dict[str, float | None] = {}
    for name, value in list((metrics or {}).items())[:MAX_METRICS_PER_ROW]:
        try:
            v = float(value)
        except (TypeError, ValueError):
            continue
        out[str(name)[:128]] = v if math.isfinite(v) else None
    return out


def thin_plan(rows: Sequence[tuple[int, int]]) -> list[int]:
    """Row ids to delete from a run's rows `(id, step)` (oldest first): every second step
    among the oldest half of its distinct steps. A run whose rows share too few steps
    (forward-only evaluation) is thinned by row instead. Pure; see the module docstring."""
    steps = sorted({step for _, step in rows})
    old = steps[: len(steps) // 2]
    if len(old) >= 2:
        dropped = set(old[1::2])
        return [rid for rid, step in rows if step in dropped]
    ids = [rid for rid, _ in rows]
    return ids[: len(ids) // 2][1::2]


def series(rows: Sequence[Any]) -> dict[str, list[tuple[int, float | None]]]:
    """`"<kind>/<metric>"` -> [(step, value)] in row order, from rows with `.kind`,
    `.step` and `.metrics` (the curves of the console and the REST answer)."""
    out: dict[str, list[tuple[int, float | None]]] = {}
    for row in rows:
        for name, value in (row.metrics or {}).items():
            out.setdefault(f"{row.kind}/{name}", []).append((int(row.step), value))
    return out


def target_tokens(output: Any) -> int:
    """Target tokens of a ForwardBackwardOutput: the length of each datum's `logprobs`."""
    total = 0
    for out in getattr(output, "loss_fn_outputs", None) or []:
        logprobs = out.get("logprobs") if isinstance(out, dict) else None
        shape = getattr(logprobs, "shape", None)
        total += int(shape[0]) if shape else len(getattr(logprobs, "data", None) or [])
    return total


def derived(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[int, float | None]]]:
    """Per-step series computed from REST rows (`{step, kind, metrics, time}`, oldest first):
    `tokens trained` (the step's forward_backward target tokens) and `trained tokens/s`
    (those tokens over the time from the previous optim_step row to this step's). Pure."""
    tokens: dict[int, float] = {}
    optim_time: dict[int, float] = {}
    for r in rows:
        if r["kind"] == "forward_backward" and (r["metrics"] or {}).get(TOKENS) is not None:
            tokens[r["step"]] = tokens.get(r["step"], 0.0) + r["metrics"][TOKENS]
        elif r["kind"] == "optim_step":
            optim_time[r["step"]] = r["time"]
    out: dict[str, list[tuple[int, float | None]]] = {}
    if tokens:
        out["tokens trained"] = sorted(tokens.items())
    for name, key in (("tokens sampled", SAMPLED), ("mean completion length", COMPLETION)):
        points = [(r["step"], r["metrics"][key]) for r in rows
                  if r["kind"] == "optim_step" and (r["metrics"] or {}).get(key) is not None]
        if points:
            out[name] = points
    rates = []
    steps = sorted(optim_time)
    for prev, step in zip(steps, steps[1:]):
        elapsed = optim_time[step] - optim_time[prev]
        if step in tokens and elapsed > 0:
            rates.append((step, tokens[step] / elapsed))
    if rates:
        out["trained tokens/s"] = rates
    return out


class MetricHistory:
    """Records rows and keeps each run under its bound. Thread-safe."""

    def __init__(self, store: Store, max_rows: int, clock: Clock = SYSTEM_CLOCK) -> None:
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0 or 0 < max_rows < 8:
            raise ValueError(f"metric_history_rows must be 0 (off) or an integer >= 8, got {max_rows!r}")
        self.store, self.max_rows = store, max_rows
        self._clock = clock  # rows' created_at (ember.service.clock)
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._thinning: set[str] = set()
        self._sampled: dict[str, list[int]] = {}  # run -> [tokens, sequences] sampled since its last step
        self._step_offset: dict[str, int] = {}  # run -> SDK step - this lifetime's step (`SDK_STEP`)
        self._thinner = ThreadPoolExecutor(1, thread_name_prefix="ember-metric-thin")

    def record(self, run_id: str, step: int, kind: str, metrics: Mapping[str, Any] | None,
               tokens: int | None = None) -> None:
        """One op's row at the SDK's step (`step`: this lifetime's count, shifted by what the
        last `optim_step`'s `step:max` said); `tokens`: the op's target tokens. Never raises:
        a lost history row must not fail a training step."""
        if not self.max_rows:
            return
        try:
            row = clean_metrics(metrics)
            if tokens is not None:
                row[TOKENS] = float(tokens)
            if kind == "optim_step":
                row.update(self._take_samples(run_id))
            self.store.insert_metrics(dict(run_id=run_id, step=self._sdk_step(run_id, int(step), kind, row),
                                           kind=kind, metrics=row, created_at=self._clock()))
            self._count(run_id)
        except Exception as exc:  # noqa: BLE001
            log.warning("run %s: metrics of a %s not recorded (%s)", run_id, kind, public_message(exc))

    def add_samples(self, run_id: str, result: Any) -> None:
        """A completed sample of one of the run's samplers (a SampleResponse): counted into
        the run's next optim_step row."""
        sequences = getattr(result, "sequences", None) or []
        with self._lock:
            acc = self._sampled.setdefault(run_id, [0, 0])
            acc[0] += sum(len(s.tokens) for s in sequences)
            acc[1] += len(sequences)

    def _take_samples(self, run_id: str) -> dict[str, float]:
        with self._lock:
            tokens, seqs = self._sampled.pop(run_id, (0, 0))
        return {SAMPLED: float(tokens), SEQUENCES: float(seqs), COMPLETION: tokens / seqs} if seqs else {}

    def _sdk_step(self, run_id: str, step: int, kind: str, row: Mapping[str, float | None]) -> int:
        if kind == "optim_step" and row.get(SDK_STEP) is not None:
            with self._lock:
                self._step_offset[run_id] = int(row[SDK_STEP]) - 1 - step
        return step + self._step_offset.get(run_id, 0)

    def _count(self, run_id: str) -> None:
        with self._lock:
            if run_id not in self._counts:  # first row of this run in this lifetime
                self._counts[run_id] = len(self.store.metric_row_steps(run_id))
            else:
                self._counts[run_id] += 1
            n = self._counts[run_id]
            start = n >= self.max_rows and run_id not in self._thinning
            if start:
                self._thinning.add(run_id)
        if n >= 2 * self.max_rows:  # the thinner is far behind: bound the table here
            self.thin(run_id)
        elif start:
            self._thinner.submit(self._thin_background, run_id)

    def _thin_background(self, run_id: str) -> None:
        try:
            self.thin(run_id)
        except Exception as exc:  # noqa: BLE001 - retried at the run's next row
            log.warning("run %s: metric history not thinned (%s)", run_id, public_message(exc))
        finally:
            with self._lock:
                self._thinning.discard(run_id)

    def thin(self, run_id: str) -> int:
        """Thin the run's rows once (`thin_plan`); how many were deleted."""
        rows = self.store.metric_row_steps(run_id)
        deleted = self.store.delete_metric_rows(thin_plan(rows))
        with self._lock:
            self._counts[run_id] = self._counts.get(run_id, len(rows)) - deleted
        return deleted

    def history(self, run_id: str) -> dict[str, Any]:
        """The REST answer: the run's rows oldest first, and its steps taken."""
        rows = self.store.metric_rows(run_id)
        steps = max((r.step + 1 for r in rows if r.kind == "optim_step"), default=0)
        return {"run_id": run_id, "steps_taken": steps, "max_rows": self.max_rows,
                "rows": [{"step": r.step, "kind": r.kind, "metrics": r.metrics, "time": r.created_at} for r in rows]}

    def forget(self, run_id: str) -> None:
        """The run is unloaded: no more rows in this lifetime."""
        with self._lock:
            self._counts.pop(run_id, None)
            self._step_offset.pop(run_id, None)
            self._sampled.pop(run_id, None)

    def close(self) -> None:
        self._thinner.shutdown(wait=True)
