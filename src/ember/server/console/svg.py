"""Line charts as plain geometry for the SVG the run pages draw on the server.

`chart(points)` turns [(step, value)] into pixel coordinates, a polyline and axis ticks;
`chart_lines([(name, points), ...], log=...)` draws several series (runs compared) on
shared axes, a log-scaled y axis when asked. `smooth(points, weight)` is TensorBoard's
debiased exponential moving average. The template writes the result as SVG elements
(autoescaped; no script, no third-party code). None values (a non-finite metric, or a
value <= 0 on a log axis) break the line. Pure functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

WIDTH, HEIGHT = 640, 220
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 12, 40
Points = Sequence[tuple[int, float | None]]


@dataclass(frozen=True)
class Point:
    step: int
    value: float | None
    x: float
    y: float | None


@dataclass(frozen=True)
class Line:
    name: str
    index: int  # its colour (`line-<index % 6>` in console.css)
    points: list[Point]
    segments: list[str]  # polyline `points` attributes, one per unbroken run of values


@dataclass(frozen=True)
class Chart:
    lines: list[Line]
    x_ticks: list[tuple[float, str]]
    y_ticks: list[tuple[float, str]]
    log: bool = False
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    bottom: float = HEIGHT - BOTTOM
    right: float = WIDTH - RIGHT
    top: int = TOP

    @property
    def points(self) -> list[Point]:
        return self.lines[0].points if self.lines else []

    @property
    def segments(self) -> list[str]:
        return self.lines[0].segments if self.lines else []


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About `n` round numbers spanning [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, n - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def label(v: float) -> str:
    return f"{v:.4g}"


def smooth(points: Points, weight: float) -> list[tuple[int, float | None]]:
    """Debiased exponential moving average (TensorBoard's smoothing): weight 0 = as is,
    towards 1 = smoother. A gap (None) stays a gap and does not reset the average."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight!r}")
    out, last, n = [], 0.0, 0
    for step, value in points:
        if value is None:
            out.append((step, None))
            continue
        last, n = last * weight + (1 - weight) * value, n + 1
        out.append((step, last / (1 - weight ** n) if weight else value))
    return out


def chart(points: Points, *, log: bool = False) -> Chart:
    return chart_lines([("", points)], log=log)


def chart_lines(series: Sequence[tuple[str, Points]], *, log: bool = False) -> Chart:
    """Several named series on one pair of axes (steps on x; values, or log10 of values > 0, on y)."""
    def y_of(v: float | None) -> float | None:
        if v is None:
            return None
        return (math.log10(v) if v > 0 else None) if log else v

    steps = [s for _, pts in series for s, _ in pts]
    values = [y for _, pts in series for _, v in pts if (y := y_of(v)) is not None]
    x0, x1 = (min(steps), max(steps)) if steps else (0, 1)
    y0, y1 = (min(values), max(values)) if values else (0.0, 1.0)
    if y1 - y0 <= 1e-9 * max(abs(y0), abs(y1)):
        y1 = y0  # equal but for rounding (a smoothed constant): one value, not a zoom into the noise
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    pad = (y1 - y0) * 0.06 or abs(y0) * 0.05 or 1.0  # points clear of the axes
    y0, y1 = y0 - pad, y1 + pad
    sx = (WIDTH - LEFT - RIGHT) / (x1 - x0)
    sy = (HEIGHT - TOP - BOTTOM) / (y1 - y0)

    def px(step: float) -> float:
        return round(LEFT + (step - x0) * sx, 2)

    def py(y: float) -> float:
        return round(HEIGHT - BOTTOM - (y - y0) * sy, 2)

    lines = []
    for i, (name, pts) in enumerate(series):
        placed = [Point(s, v, px(s), None if (y := y_of(v)) is None else py(y)) for s, v in pts]
        lines.append(Line(name, i, placed, _segments(placed)))
    x_ticks = [(px(t), str(int(t))) for t in nice_ticks(x0, x1) if float(t).is_integer()]
    if log:
        y_ticks = [(py(t), label(10 ** t)) for t in nice_ticks(y0, y1) if float(t).is_integer()] or \
            [(py(t), label(10 ** t)) for t in nice_ticks(y0, y1)]
    else:
        y_ticks = [(py(t), label(t)) for t in nice_ticks(y0, y1)]
    return Chart(lines, x_ticks, y_ticks, log)


def _segments(placed: list[Point]) -> list[str]:
    segments, current = [], []
    for p in placed:
        if p.y is None:
            if current:
                segments.append(" ".join(current))
            current = []
        else:
            current.append(f"{p.x},{p.y}")
    if current:
        segments.append(" ".join(current))
    return segments
