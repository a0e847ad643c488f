"""Rich progress bars for recipe phases, with live metrics (loss, reward, accuracy).

`with PhaseProgress() as progress:` then `on_step = progress.phase("GRPO", total, {...})`
gives a `StepHook` for the recipes. A metric recorded at every step so far (loss,
reward) shows its average over the last `window` steps; one recorded only on some steps
(held-out accuracy, every `eval_every` steps) shows its last value, never an average of
evaluations. Without a terminal (or `live=False`) it prints a plain line every
`every` steps instead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ember.recipes.common import StepHook


class PhaseProgress:
    def __init__(self, console: Console | None = None, live: bool | None = None, window: int = 20, every: int = 50):
        self.console = console or Console()
        self.live = self.console.is_terminal if live is None else live
        self.window, self.every = window, every
        self._progress = Progress(
            TextColumn("[bold]{task.description:<16}"), BarColumn(bar_width=30), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
            console=self.console, disable=not self.live,
        )

    def __enter__(self) -> PhaseProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()

    def print(self, *args, **kwargs) -> None:
        self._progress.console.print(*args, **kwargs)

    def phase(self, name: str, total: int, fields: Mapping[str, str]) -> StepHook:
        """A bar for `total` steps showing `fields` (metric key -> label) after each step."""
        task = self._progress.add_task(name, total=total, info="")
        recent: dict[str, deque[float]] = {key: deque(maxlen=self.window) for key in fields}
        counts = dict.fromkeys(fields, 0)
        steps = [0]

        def on_step(step: int, metrics: dict[str, float]) -> None:
            steps[0] += 1
            for key in fields:
                if metrics.get(key) is not None:
                    recent[key].append(metrics[key])
                    counts[key] += 1
            info = "  ".join(f"{label} {_shown(recent[key], counts[key] == steps[0]):.3f}"
                             for key, label in fields.items() if recent[key])
            self._progress.update(task, completed=step + 1, info=info)
            if not self.live and ((step + 1) % self.every == 0 or step + 1 == total):
                self.console.print(f"{name} {step + 1}/{total}  {info}")

        return on_step


def _shown(values: deque[float], every_step: bool) -> float:
    """The window mean of a metric recorded at every step, else its last value."""
    return sum(values) / len(values) if every_step else values[-1]
