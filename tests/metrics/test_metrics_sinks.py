"""Sinks: console, JSONL, TensorBoard (read back from the event files), W&B import guard."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from ember.metrics import (
    ConsoleSink,
    JsonlSink,
    MetricsConfig,
    MetricsLogger,
    TensorBoardSink,
    WandbSink,
    build_sinks,
    read_jsonl,
)


def test_jsonl_rows_and_non_finite_as_null(tmp_path):
    sink = JsonlSink(tmp_path / "sub" / "m.jsonl")
    logger = MetricsLogger([sink])
    logger.record("loss", 0.5)
    logger.flush(0)
    logger.record("loss", math.nan)
    logger.record("inf", math.inf, "max")
    logger.flush(1)
    logger.close()
    rows = read_jsonl(tmp_path / "sub" / "m.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["loss"] == 0.5 and rows[1]["loss"] is None and rows[1]["inf"] is None
    # strict JSON (no NaN literals)
    for line in (tmp_path / "sub" / "m.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    with pytest.raises(RuntimeError, match="closed"):
        sink.write(2, {"x": 1.0})


def test_console_sink_prints_selected_keys_every_n_steps():
    lines: list[str] = []
    sink = ConsoleSink(keys=["reward", "missing"], print_fn=lines.append, every=2)
    for step in range(4):
        sink.write(step, {"reward": 0.25 * step, "other": 1.0})
    assert lines == ["step 0 | reward 0", "step 2 | reward 0.5"]
    with pytest.raises(ValueError, match="every must be >= 1"):
        ConsoleSink(every=0)


def test_tensorboard_event_files_hold_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path / "tb")
    for step in range(3):
        sink.write(step, {"grpo/reward": 0.1 * step})
    sink.close()
    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    events = ea.Scalars("grpo/reward")
    assert [e.step for e in events] == [0, 1, 2]
    assert [e.value for e in events] == pytest.approx([0.0, 0.1, 0.2], abs=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed; the guard is not reachable")
def test_wandb_is_optional_and_says_what_to_install():
    with pytest.raises(ImportError, match="pip install wandb"):
        WandbSink(project="p")


def test_build_sinks_from_config(tmp_path):
    sinks = build_sinks(MetricsConfig(console=False, tensorboard=False), tmp_path)
    assert [type(s) for s in sinks] == [JsonlSink]
    sinks[0].close()
    sinks = build_sinks(MetricsConfig(console=True, console_every=5), tmp_path)
    assert [type(s) for s in sinks] == [ConsoleSink, JsonlSink, TensorBoardSink]
    assert sinks[0].every == 5
    for s in sinks:
        s.close()
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "tensorboard").is_dir()
    with pytest.raises(ValueError, match="console_every"):
        MetricsConfig(console_every=0)
