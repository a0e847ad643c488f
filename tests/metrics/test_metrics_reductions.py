"""record_metric reductions across micro-batches and steps, spans, prefixes, Tinker keys."""

from __future__ import annotations

import math
import time

import pytest
import torch

from ember.metrics import MetricAccumulator, MetricsLogger, metric_prefix, record_metric, span, use_logger


def test_reductions_across_micro_batches():
    acc = MetricAccumulator()
    for v in (1.0, 2.0, 6.0):
        acc.record("loss", v, "mean")
        acc.record("tokens", v, "sum")
        acc.record("lo", v, "min")
        acc.record("hi", v, "max")
    assert acc.summary() == {"hi": 6.0, "lo": 1.0, "loss": 3.0, "tokens": 9.0}


def test_mean_across_steps_is_over_all_values_not_mean_of_means():
    logger = MetricsLogger()
    logger.record("x", 0.0)
    logger.flush(0)
    for v in (3.0, 3.0, 3.0):
        logger.record("x", v)
    assert logger.flush(1) == {"x": 3.0}
    # (0 + 3 + 3 + 3) / 4, not (0 + 3) / 2
    assert logger.window()["x"] == pytest.approx(2.25, abs=1e-12)
    assert [s for s, _ in logger.history] == [0, 1]


def test_sum_min_max_across_steps_and_reset():
    logger = MetricsLogger()
    for step, values in enumerate([(1.0, 5.0), (-2.0,)]):
        for v in values:
            logger.record("s", v, "sum")
            logger.record("m", v, "min")
            logger.record("M", v, "max")
        logger.flush(step)
    assert logger.window(reset=True) == {"M": 5.0, "m": -2.0, "s": 4.0}
    assert logger.window() == {}


def test_accepts_tensors_and_rejects_bad_values():
    acc = MetricAccumulator()
    acc.record("t", torch.tensor(2.5))
    acc.record("t", torch.tensor([0.5]))
    assert acc.summary()["t"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="'v'.*expected a scalar"):
        acc.record("v", torch.ones(3))
    with pytest.raises(ValueError, match="'s'.*expected a number, got str"):
        acc.record("s", "1.0")
    with pytest.raises(ValueError, match="reduce must be one of"):
        acc.record("r", 1.0, "median")


def test_one_key_one_reduction():
    acc = MetricAccumulator()
    acc.record("loss", 1.0, "sum")
    with pytest.raises(ValueError, match="'loss' was recorded with reduce='sum' and now with reduce='mean'"):
        acc.record("loss", 1.0, "mean")


def test_empty_mean_is_nan_and_merge():
    a, b = MetricAccumulator(), MetricAccumulator()
    a.record("x", 1.0)
    b.record("x", 4.0)
    b.record("y", 2.0, "max")
    a.merge(b)
    assert a.summary() == {"x": 2.5, "y": 2.0}
    from ember.metrics import Stat

    assert math.isnan(Stat("mean").value())


def test_record_metric_goes_to_the_installed_logger_with_prefix_and_spans():
    logger = MetricsLogger()
    with use_logger(logger):
        with metric_prefix("grpo/"):
            record_metric("reward", 1.0)
            record_metric("reward", 0.0)
            with span("sample"):
                time.sleep(0.02)
            with span("sample"):
                time.sleep(0.02)
            with metric_prefix("inner/"):
                record_metric("x", 7, "max")
        record_metric("plain", 2.0)
    out = logger.flush(3)
    assert out["grpo/reward"] == 0.5
    assert out["grpo/inner/x"] == 7.0
    assert out["plain"] == 2.0
    assert 0.04 <= out["grpo/time/sample"] < 1.0  # two spans summed
    record_metric("elsewhere", 1.0)  # the default logger, not ours
    assert "elsewhere" not in logger.pending()


def test_record_dict_reads_tinker_reductions():
    logger = MetricsLogger()
    logger.record_dict({"loss:sum": 2.0, "clip:mean": 0.5, "plain": 3.0}, prefix="fb/")
    logger.record_dict({"loss:sum": 1.0, "clip:mean": 1.0, "plain": 1.0}, prefix="fb/")
    assert logger.flush(0) == {"fb/clip": 0.75, "fb/loss": 3.0, "fb/plain": 2.0}
