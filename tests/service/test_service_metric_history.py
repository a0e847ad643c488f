"""The per-step metric history (`ember.service.metric_history`): one row per op, bounded
per run by thinning the older half, kept across a reopen of the database."""

from __future__ import annotations

import math

import pytest

from ember.service.metric_history import MetricHistory, clean_metrics, series, thin_plan
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
