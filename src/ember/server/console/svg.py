"""Line charts as plain geometry for the SVG the run page draws on the server.

`chart(points)` turns [(step, value)] into pixel coordinates, a polyline and axis ticks:
the template writes them as SVG elements (autoescaped; no script, no third-party code).
None values (a non-finite metric) break the line. Pure functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

WIDTH, HEIGHT = 640, 220
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 12, 40


@dataclass(frozen=True)
class Point:
    step: int
    value: float | None
    x: float
    y: float | None


@dataclass(frozen=True)
class Chart:
    points: list[Point]
    segments: list[str]  # polyline `points` attributes, one per unbroken run of values
    x_ticks: list[tuple[float, str]]
    y_ticks: list[tuple[float, str]]
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    bottom: float = HEIGHT - BOTTOM
    right: float = WIDTH - RIGHT
    top: int = TOP


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


def chart(points: Sequence[tuple[int, float | None]]) -> Chart:
    steps = [s for s, _ in points]
    values = [v for _, v in points if v is not None]
    x0, x1 = (min(steps), max(steps)) if steps else (0, 1)
    y0, y1 = (min(values), max(values)) if values else (0.0, 1.0)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    pad = (y1 - y0) * 0.06 or abs(y0) * 0.05 or 1.0  # points clear of the axes
    y0, y1 = y0 - pad, y1 + pad
    sx = (WIDTH - LEFT - RIGHT) / (x1 - x0)
    sy = (HEIGHT - TOP - BOTTOM) / (y1 - y0)

    def px(step: float) -> float:
        return round(LEFT + (step - x0) * sx, 2)

    def py(value: float) -> float:
        return round(HEIGHT - BOTTOM - (value - y0) * sy, 2)

    placed = [Point(s, v, px(s), None if v is None else py(v)) for s, v in points]
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
    x_ticks = [(px(t), str(int(t))) for t in nice_ticks(x0, x1) if float(t).is_integer()]
    y_ticks = [(py(t), label(t)) for t in nice_ticks(y0, y1)]
    return Chart(placed, segments, x_ticks, y_ticks)
