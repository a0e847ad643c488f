"""`ember.sampling.scoped_env`: a variable set for the block only, the caller's value (or its
absence) back afterwards, also when the block raises."""

from __future__ import annotations

import os
import threading

import pytest

from ember.sampling.scoped_env import scoped_env

NAME = "EMBER_TEST_SCOPED_ENV"


def test_set_inside_and_restored_or_removed_after(monkeypatch):
    lock = threading.Lock()
    monkeypatch.delenv(NAME, raising=False)
    with scoped_env(lock, NAME, "1"):
        assert os.environ[NAME] == "1" and lock.locked()
    assert NAME not in os.environ and not lock.locked()
    monkeypatch.setenv(NAME, "caller")
    with pytest.raises(RuntimeError), scoped_env(lock, NAME, lambda before: f"{before}+mine"):
        assert os.environ[NAME] == "caller+mine"
        raise RuntimeError("the block fails")
    assert os.environ[NAME] == "caller"
