"""The console's chart geometry (`ember.server.console.svg`): smoothing, several series on
shared axes, a log scale. Pure functions, no server."""

from __future__ import annotations

import math

import pytest

from ember.server.console.svg import HEIGHT, chart, chart_lines, smooth


def test_smoothing_is_the_debiased_moving_average():
    points = [(0, 1.0), (1, 3.0), (2, None), (3, 2.0)]
    assert smooth(points, 0.0) == points
    w = 0.6
    ema1 = (1 - w) * 1.0
    ema2 = w * ema1 + (1 - w) * 3.0
    ema3 = w * ema2 + (1 - w) * 2.0
    got = smooth(points, w)
    assert got[0] == (0, pytest.approx(1.0, rel=1e-12))  # debiased: the first value is itself
    assert got[1] == (1, pytest.approx(ema2 / (1 - w ** 2), rel=1e-12))
    assert got[2] == (2, None)  # a gap stays a gap
    assert got[3] == (3, pytest.approx(ema3 / (1 - w ** 3), rel=1e-12))
    with pytest.raises(ValueError, match="smoothing weight"):
        smooth(points, 1.0)


def test_several_series_share_axes():
    g = chart_lines([("a", [(0, 1.0), (10, 2.0)]), ("b", [(5, 4.0)])])
    a, b = g.lines
    assert (a.name, b.name) == ("a", "b") and (a.index, b.index) == (0, 1)
    assert a.points[0].x < b.points[0].x < a.points[1].x  # one x axis: step 5 between 0 and 10
    assert b.points[0].y < a.points[1].y < a.points[0].y  # one y axis: 4 above 2 above 1 (SVG y grows down)
    assert g.points == a.points and g.segments == a.segments  # a single chart reads as before


def test_log_scale_places_decades_evenly_and_drops_non_positive_values():
    g = chart([(0, 1.0), (1, 10.0), (2, 100.0), (3, 0.0), (4, -1.0)], log=True)
    ys = [p.y for p in g.points]
    assert ys[3] is None and ys[4] is None  # no logarithm: a gap
    assert math.isclose(ys[0] - ys[1], ys[1] - ys[2], rel_tol=1e-3)
    assert len(g.segments) == 1
    assert {"1", "10", "100"} <= {label for _, label in g.y_ticks}
    assert all(0 <= y <= HEIGHT for y, _ in g.y_ticks)


def test_a_smoothed_constant_is_one_value():
    g = chart([(0, 4.0), (1, 4.000000000000001)], log=True)
    assert len({label for _, label in g.y_ticks}) == len(g.y_ticks)  # no tick label twice
