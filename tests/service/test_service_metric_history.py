"""The per-step metric history (`ember.service.metric_history`): one row per op, bounded
per run by thinning the older half, kept across a reopen of the database."""

from __future__ import annotations

import math

import pytest

from ember.service.metric_history import (
    COMPLETION, SAMPLED, SEQUENCES, TOKENS, MetricHistory, clean_metrics, derived, series, thin_plan,
)
from ember.service.store import Store


def test_thin_plan_drops_every_second_old_step_and_keeps_the_new_half():
    rows = [(i * 2 + k, i) for i in range(8) for k in range(2)]  # 2 rows (fb, optim) per step 0..7
    dropped = set(thin_plan(rows))
    kept_steps = sorted({step for rid, step in rows if rid not in dropped})
    assert kept_steps == [0, 2, 4, 5, 6, 7]  # old half 0..3 -> 0, 2; new half whole
    assert all((rid in dropped) == (step in (1, 3)) for rid, step in rows)  # a step goes with all its kinds


def test_thin_plan_by_row_when_steps_do_not_vary():
    rows = [(i, 0) for i in range(10)]  # forward-only evaluation: every row at step 0
    assert thin_plan(rows) == [1, 3]


def test_clean_metrics_is_json_safe():
    assert clean_metrics({"a": 1, "b": float("nan"), "c": "x", 3: 2.5}) == {"a": 1.0, "b": None, "3": 2.5}


@pytest.fixture
def store(tmp_path):
    s = Store(f"sqlite:///{tmp_path / 'ember.db'}")
    yield s
    s.close()


def test_rows_bounded_by_thinning_and_span_kept(store):
    history = MetricHistory(store, max_rows=16)
    for step in range(100):
        history.record("run-a", step, "forward_backward", {"loss:sum": float(step)})
        history.record("run-a", step, "optim_step", {"learning_rate:mean": 1e-3})
    history.close()  # waits for the background thinning
    rows = store.metric_rows("run-a")
    assert len(rows) <= 2 * 16
    steps = [r.step for r in rows]
    assert steps[0] == 0 and steps[-1] == 99  # the whole span is kept, coarser when older
    assert steps == sorted(steps)
    assert history.history("run-a")["steps_taken"] == 100
    assert store.steps_taken(["run-a", "run-b"]) == {"run-a": 100}
    curves = series(rows)
    assert [s for s, _ in curves["forward_backward/loss:sum"]] == [s for s, _ in curves["optim_step/learning_rate:mean"]]


def test_history_survives_reopen_and_zero_turns_it_off(tmp_path):
    url = f"sqlite:///{tmp_path / 'ember.db'}"
    first = Store(url)
    MetricHistory(first, 64).record("run-a", 0, "forward", {"loss:sum": math.pi})
    off = MetricHistory(first, 0)
    off.record("run-b", 0, "forward", {"loss:sum": 1.0})
    first.close()
    again = Store(url)
    try:
        rows = MetricHistory(again, 64).history("run-a")["rows"]
        assert [(r["step"], r["kind"], r["metrics"]) for r in rows] == [(0, "forward", {"loss:sum": math.pi})]
        assert again.metric_rows("run-b") == []
    finally:
        again.close()


@pytest.mark.parametrize("bad", [-1, 3, True, 2.5])
def test_bad_bound_is_refused(store, bad):
    with pytest.raises(ValueError, match="metric_history_rows"):
        MetricHistory(store, bad)


def test_rows_are_at_the_sdks_step_after_a_resume(store):
    """A run loaded from a checkpoint with its optimizer starts this lifetime at step 0, but
    its optim_step says `step:max` 8: rows are at the SDK's step from then on."""
    history = MetricHistory(store, 64)
    history.record("run-a", 0, "forward_backward", {"loss:sum": 1.0}, tokens=5)
    history.record("run-a", 0, "optim_step", {"step:max": 8.0})
    history.record("run-a", 1, "forward_backward", {"loss:sum": 0.5}, tokens=6)
    history.record("run-a", 1, "optim_step", {"step:max": 9.0})
    rows = history.history("run-a")["rows"]
    assert [(r["kind"], r["step"]) for r in rows] == [("forward_backward", 0), ("optim_step", 7),
                                                      ("forward_backward", 8), ("optim_step", 8)]
    assert rows[2]["metrics"][TOKENS] == 6.0
    history.close()


class _Seq:
    def __init__(self, n: int):
        self.tokens = list(range(n))


class _Sample:
    def __init__(self, *lengths: int):
        self.sequences = [_Seq(n) for n in lengths]


def test_samples_count_into_the_next_step_and_derived_series():
    history = MetricHistory(_NullStore(), 64)  # the rows it writes, without a database
    history.add_samples("run-a", _Sample(3, 5))
    history.add_samples("run-a", _Sample(4))
    history.record("run-a", 0, "optim_step", {})
    history.record("run-a", 1, "optim_step", {})  # nothing sampled in between: no sample figures
    first, second = history.store.rows
    assert first["metrics"] == {SAMPLED: 12.0, SEQUENCES: 3.0, COMPLETION: 4.0}
    assert second["metrics"] == {}
    history.close()
    rows = [{"step": 0, "kind": "forward_backward", "metrics": {TOKENS: 10.0}, "time": 99.0},
            {"step": 0, "kind": "optim_step", "metrics": {SAMPLED: 12.0, COMPLETION: 4.0}, "time": 100.0},
            {"step": 1, "kind": "forward_backward", "metrics": {TOKENS: 30.0}, "time": 101.0},
            {"step": 1, "kind": "forward_backward", "metrics": {TOKENS: 10.0}, "time": 101.5},
            {"step": 1, "kind": "optim_step", "metrics": {}, "time": 102.0}]
    assert derived(rows) == {"tokens trained": [(0, 10.0), (1, 40.0)], "trained tokens/s": [(1, 20.0)],
                             "tokens sampled": [(0, 12.0)], "mean completion length": [(0, 4.0)]}


class _NullStore:
    """Keeps inserted rows in a list (what `record` writes)."""

    def __init__(self):
        self.rows = []

    def insert_metrics(self, values):
        self.rows.append(values)

    def metric_row_steps(self, run_id):
        return [(i, r["step"]) for i, r in enumerate(self.rows)]
