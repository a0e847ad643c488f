"""A fast variant of `ember demo`: the GRPO reward rises; the run directory has everything."""

from __future__ import annotations

import argparse
import io
import json
import statistics

import pytest
from rich.console import Console

from ember.metrics import read_jsonl
from ember.recipes.demo import QUICK, DemoSettings, add_arguments, settings_from_args

# A fast variant of the demo (about 20 s of training): numbers of 1-2 digits, 40 labels, and
# GRPO on the remaining unlabelled numbers at a higher constant LR, one step off-policy as
# the demo's default. First calibrated (at a7898d1) on seeds 0, 1, 2: the mean reward of the
# last 15 GRPO steps exceeded that of the first 15 by +0.029..+0.098 (+0.087 for seed 0).
# Calibrated again for issue 15 on this code (2-core CPU, 1 thread): seed 0 gives +0.030,
# the same rewards on two runs (the run is deterministic; staleness is always 1); seeds
# 0-5 give +0.030, +0.020, -0.001, +0.052, +0.077, +0.041 (mean +0.036, sd 0.027). The
# per-step reward has sd 0.055, so a 15-step mean moves by ~0.014 and the first-vs-last
# difference by ~0.02 from sampling noise alone. The old threshold, +0.03, sat at seed 0's
# own value (a margin of 0.0002). 60 steps are deep in what the demo's plain-PyTorch
# calibration of digit sums found to be GRPO's slow start ("the first 500 are slow"; the
# full demo runs 1500), so only a small rise is supported: the assertion
# now asks that the reward rises at all (last > first), a margin of +0.030 (~1.5 sd of the
# noise) for seed 0; 5 of the 6 seeds pass it.
FAST = dict(seed=0, min_digits=1, max_digits=2, labels=40, heldout=19, sft_steps=80, sft_batch=32,
            grpo_steps=60, prompts_per_step=8, grpo_lr=5e-4, grpo_schedule="constant", eval_every=30,
            max_tokens=5, control_steps=5)


def test_demo_arguments_map_to_settings():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    s = settings_from_args(parser.parse_args(["--quick", "--grpo-steps", "7", "--seed", "3"]))
    assert s.seed == 3 and s.grpo_steps == 7 and s.sft_steps == QUICK["sft_steps"]
    assert s.control_steps == 7 and s.control_batch == s.prompts_per_step  # control defaults follow GRPO
    assert settings_from_args(parser.parse_args([])) == DemoSettings()


@pytest.mark.slow
def test_fast_demo_reward_rises_and_writes_the_run_directory(tmp_path):
    from ember.recipes.demo_run import run_demo

    out = io.StringIO()
    run_dir = tmp_path / "demo-run"
    summary = run_demo(DemoSettings(**FAST), run_dir, live=False, console=Console(file=out, width=120))

    rewards = [r["grpo/reward"] for r in read_jsonl(run_dir / "metrics.jsonl") if "grpo/reward" in r]
    assert len(rewards) == FAST["grpo_steps"]
    first, last = statistics.mean(rewards[:15]), statistics.mean(rewards[-15:])
    assert last > first, (first, last, rewards)  # the threshold: see FAST's comment

    assert summary["completed"] and 0.0 <= summary["sft_accuracy"] <= 1.0
    assert {"init_accuracy", "grpo_accuracy", "control_accuracy", "margin_over_control"} <= set(summary)
    assert json.loads((run_dir / "summary.json").read_text())["grpo_accuracy"] == summary["grpo_accuracy"]
    assert (run_dir / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    text = out.getvalue()
    for name in ("metrics.jsonl", "tensorboard", "plot.png", "GRPO margin over the control"):
        assert name in text, text


@pytest.mark.slow
def test_demo_on_an_existing_checkpoint_directory(digit_model_dir, tmp_path, capsys):
    """`ember demo --model DIR` (a real HF checkpoint on GPU; here the tiny one, a few steps)."""
    from ember.cli import main

    run_dir = tmp_path / "real"
    argv = ["demo", "--model", str(digit_model_dir), "--run-dir", str(run_dir), "--no-progress",
            "--sft-steps", "2", "--sft-batch", "4", "--grpo-steps", "2", "--prompts-per-step", "2",
            "--group-size", "2", "--heldout", "4", "--eval-every", "2", "--threads", "1"]
    assert main(argv) == 0
    settings = json.loads((run_dir / "settings.json").read_text())
    assert settings["model"] == str(digit_model_dir.resolve())
    assert settings["lora_rank"] == 32 and settings["max_tokens"] == 8  # the real-model defaults
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] and summary["control_accuracy"] >= 0.0
    assert "GRPO margin over the control" in capsys.readouterr().out
