"""The in-process clients retry a submission the service is too busy for (`BusyError`,
HTTP 429 over the wire, which the SDK retries), as the SDK does: `retry_busy`."""

from __future__ import annotations

import time

import pytest

from ember.client.context import retry_busy
from ember.service.api import BusyError


def busy(message: str, after_s: float = 0.01) -> BusyError:
    exc = BusyError(message)
    exc.retry_after_s = after_s
    return exc


def test_a_busy_submission_is_retried_until_it_is_taken():
    calls = []

    def submit():
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise busy("images: over this key's share; retry")
        return "submitted"

    assert retry_busy(submit) == "submitted" and len(calls) == 3
    assert calls[2] - calls[0] >= 0.02  # it waited Retry-After between tries


def test_busy_past_the_deadline_raises_and_other_errors_at_once():
    with pytest.raises(BusyError, match="still busy"):
        retry_busy(lambda: (_ for _ in ()).throw(busy("still busy")), give_up_s=0.05)
    calls = []

    def bad():
        calls.append(1)
        raise ValueError("not busy: wrong")

    with pytest.raises(ValueError, match="not busy"):
        retry_busy(bad)
    assert calls == [1]
