"""`MetricsConfig`: which sinks a run writes to, built into sink objects by `build_sinks`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ember.metrics.sinks import ConsoleSink, JsonlSink, MetricSink, TensorBoardSink, WandbSink


@dataclass
class MetricsConfig:
    """Sinks of one run; files go under the run directory.

    console: print one line every `console_every` steps.
    jsonl: write `metrics.jsonl`.
    tensorboard: write event files under `tensorboard/` (needs the tensorboard package).
    wandb_project: a W&B project name turns the W&B sink on (needs wandb); empty = off.
    """

    console: bool = True
    console_every: int = 10
    jsonl: bool = True
    tensorboard: bool = True
    wandb_project: str = ""
    wandb_run_name: str = ""

    def __post_init__(self) -> None:
        if self.console_every < 1:
            raise ValueError(f"MetricsConfig.console_every must be >= 1, got {self.console_every}")


def build_sinks(config: MetricsConfig, run_dir: str | os.PathLike, console_print=print) -> list[MetricSink]:
    run_dir = Path(run_dir)
    sinks: list[MetricSink] = []
    if config.console:
        sinks.append(ConsoleSink(print_fn=console_print, every=config.console_every))
    if config.jsonl:
        sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
    if config.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if config.wandb_project:
        sinks.append(WandbSink(config.wandb_project, run_name=config.wandb_run_name or run_dir.name))
    return sinks
