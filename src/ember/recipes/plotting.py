"""PNG plots of a run's metrics JSONL (matplotlib, headless)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ember.metrics import read_jsonl


def series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that carry `key` with a finite value."""
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [s for s, _ in pts], [v for _, v in pts]


def moving_average(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_demo(metrics_path: str | os.PathLike, out_path: str | os.PathLike, summary: dict[str, float]) -> Path:
    """Left: SFT loss (warm-up and control). Right: GRPO reward and held-out accuracies per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(metrics_path)
    fig, (ax_sft, ax_rl) = plt.subplots(1, 2, figsize=(12, 4.5))
    warmup_steps, warmup_loss = series(rows, "sft/loss")
    control_steps, control_loss = series(rows, "control/loss")
    offset = warmup_steps[-1] + 1 if warmup_steps else 0  # the control continues from the warm-up
    if warmup_steps:
        ax_sft.plot(warmup_steps, warmup_loss, label="SFT warm-up")
    if control_steps:
        ax_sft.plot([offset + s for s in control_steps], control_loss, label="SFT-only control (continued)")
    ax_sft.set(title="SFT on the fixed labelled set", xlabel="optimizer step", ylabel="token-mean NLL",
               yscale="log")
    ax_sft.legend()

    steps, reward = series(rows, "grpo/reward")
    if steps:
        ax_rl.plot(steps, reward, color="tab:orange", alpha=0.25, linewidth=0.8)
        ax_rl.plot(steps, moving_average(reward, 25), color="tab:orange", label="GRPO reward (train batch, avg 25)")
    for key, label, color in (("grpo/heldout_acc", "held-out accuracy, GRPO", "tab:blue"),
                              ("control/heldout_acc", "held-out accuracy, SFT-only control", "tab:gray")):
        s, v = series(rows, key)
        if s:
            ax_rl.plot(s, v, marker="o", color=color, label=label)
    if "sft_accuracy" in summary:
        ax_rl.axhline(summary["sft_accuracy"], color="black", linestyle=":", label="after SFT warm-up")
    ax_rl.set(title="RL from a verifier on unlabelled prompts", xlabel="step (GRPO / control SFT)",
              ylabel="exact match", ylim=(0, 1))
    ax_rl.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    out = Path(out_path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
