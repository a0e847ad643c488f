"""Where reduced metrics go: console, JSONL, TensorBoard, Weights & Biases.

Every sink takes `write(step, metrics)` with already-reduced floats and `close()`.
TensorBoard and W&B are optional dependencies, imported only when such a sink is built,
with an error that says what to install.
"""

from __future__ import annotations

import abc
import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any


class MetricSink(abc.ABC):
    """Receives one dict of reduced metrics per step."""

    @abc.abstractmethod
    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None:  # noqa: B027 - most sinks have nothing to release
        """Flush and release files or connections."""


class ConsoleSink(MetricSink):
    """One line per step, `step 12 | loss 0.4312 | reward 0.5`; `keys` limits what is shown."""

    def __init__(self, keys: list[str] | None = None, print_fn=print, every: int = 1) -> None:
        if every < 1:
            raise ValueError(f"ConsoleSink.every must be >= 1, got {every}")
        self.keys, self.print_fn, self.every = keys, print_fn, every

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if step % self.every:
            return
        shown = [k for k in (self.keys or sorted(metrics)) if k in metrics]
        self.print_fn(f"step {step} | " + " | ".join(f"{k} {_fmt(metrics[k])}" for k in shown))


def _fmt(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


class JsonlSink(MetricSink):
    """One JSON object per line: {"step": n, "time": unix seconds, <key>: value, ...}.

    Non-finite values are written as null (strict JSON has no NaN/inf).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._file is None:
            raise RuntimeError(f"JsonlSink({self.path}) is closed")
        row: dict[str, Any] = {"step": step, "time": round(time.time(), 3)}
        row.update({k: (v if math.isfinite(v) else None) for k, v in metrics.items()})
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows a `JsonlSink` wrote, in order."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class TensorBoardSink(MetricSink):
    """Scalars in TensorBoard event files under `log_dir` (needs the `tensorboard` package).

    Events are flushed every `flush_secs` and on `close()` (not per step: a flush per step
    costs more than a small model's training step).
    """

    def __init__(self, log_dir: str | os.PathLike, flush_secs: float = 10.0) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # tensorboard is the `plot` extra
            raise ImportError(
                "TensorBoardSink needs the tensorboard package: pip install 'ember[plot]' (or tensorboard)"
            ) from e
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink(MetricSink):
    """Weights & Biases run (optional: off unless configured; needs the `wandb` package)."""

    def __init__(self, project: str, run_name: str | None = None, config: dict | None = None, **init_kwargs) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                f"WandbSink(project={project!r}) needs the wandb package: pip install wandb "
                "(or leave metrics.wandb_project unset)"
            ) from e
        self._run = wandb.init(project=project, name=run_name, config=config or {}, **init_kwargs)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()
