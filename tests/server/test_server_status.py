"""The status line's text and rates (`ember.server.status`), without a server; the line in a
running `ember serve`: tests/server/test_server_start_stop.py."""

from __future__ import annotations

import logging
import time

import pytest

from ember.server.status import LogConfig, StatusReporter, status_line
from helpers.server import wait_until

STATE = {"runs": 2, "sessions": 3, "samplers": 1, "lanes": {"lane 0 (tiny)": (2, 5)}, "samples_queued": 7,
         "futures_pending": 4}


def test_the_line_says_what_the_server_holds_and_the_rates_over_the_interval():
    line = status_line(STATE, {"trained_tokens": 1300.0, "sampled_tokens": 600.0},
                       {"trained_tokens": 100.0, "sampled_tokens": 0.0}, 60.0)
    assert line == ("status: 2 runs, 3 sessions, 1 sampling sessions loaded; queued: lane 0 (tiny): 2 runs, "
                    "5 waiting; 7 samples; 4 futures pending; 20 trained tok/s, 10 sampled tok/s (last 60 s)")
    idle = status_line({**STATE, "lanes": {}}, {"trained_tokens": 5.0}, {"trained_tokens": 5.0}, 60.0)
    assert "queued: no training lane;" in idle and "0 trained tok/s" in idle


def test_the_reporter_logs_every_interval_until_stopped(caplog):
    totals = iter(range(0, 10_000, 100))
    reporter = StatusReporter(0.05, lambda: STATE, lambda: {"trained_tokens": float(next(totals))})

    def lines() -> list[str]:  # only the reporter's: an SDK client of another test may log here too
        return [r.getMessage() for r in caplog.records if r.name == "ember.status"]

    with caplog.at_level(logging.INFO, logger="ember.status"):
        reporter.start()
        wait_until(lambda: len(lines()) >= 3, timeout=30, interval=0.05, message="three status lines")
        reporter.stop()
        n = len(lines())
        time.sleep(0.15)  # three more intervals: a reporter still running would log again
    assert len(lines()) == n  # nothing after stop()
    assert all(line.startswith("status: 2 runs") for line in lines())


def test_zero_means_no_line_and_negative_is_refused():
    reporter = StatusReporter(0, lambda: STATE, dict).start()
    reporter.stop()  # never started: nothing to join
    with pytest.raises(ValueError, match="log.status_every_s must be >= 0"):
        LogConfig(status_every_s=-1)
