"""ember.failpoints: parsing, counts, and that an unknown name or action is refused."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
from sqlalchemy.exc import OperationalError

from ember import failpoints


@pytest.fixture(autouse=True)
def _clean():
    failpoints.disarm()
    yield
    failpoints.disarm()


def test_unarmed_point_does_nothing():
    failpoints.hit("checkpoint.after_write")


def test_counted_actions_fire_then_stop():
    failpoints.arm("futures.finish_write", "dblocked", times=2)
    for _ in range(2):
        with pytest.raises(OperationalError, match="database is locked"):
            failpoints.hit("futures.finish_write")
    failpoints.hit("futures.finish_write")  # spent


def test_enospc_and_raise():
    failpoints.arm("checkpoint.after_write", "enospc")
    with pytest.raises(OSError) as info:
        failpoints.hit("checkpoint.after_write")
    assert info.value.errno == errno.ENOSPC
    failpoints.arm("checkpoint.after_write", "raise")
    with pytest.raises(failpoints.FailPointError, match="checkpoint.after_write"):
        failpoints.hit("checkpoint.after_write")
    failpoints.arm("checkpoint.after_write", "valueerror")  # a bug's ValueError: not the caller's fault
    with pytest.raises(ValueError, match=r"could not be broadcast .*checkpoint.after_write") as info:
        failpoints.hit("checkpoint.after_write")
    assert type(info.value) is ValueError
    failpoints.arm("sampler.stop_strings", "decodeerror", times=1)  # a tokenizer's failure on a broken byte
    with pytest.raises(UnicodeDecodeError, match="sampler.stop_strings"):
        failpoints.hit("sampler.stop_strings")
    failpoints.hit("sampler.stop_strings")  # *1: fired once


@pytest.mark.parametrize("name,action", [("no.such.point", "kill"), ("checkpoint.after_write", "explode"),
                                         ("checkpoint.after_write", "sleep")])
def test_unknown_names_and_actions_are_refused(name, action):
    with pytest.raises(ValueError, match="unknown fail point"):
        failpoints.arm(name, action)


def test_kill_from_the_environment_kills_the_process():
    code = "from ember import failpoints; failpoints.hit('checkpoint.before_write'); print('survived')"
    env = {**os.environ, failpoints.ENV: "checkpoint.before_write=kill*1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9 and "survived" not in proc.stdout


def test_at_k_lets_the_first_hits_pass():
    assert failpoints.parse("checkpoint.after_write=raise*1@3")["checkpoint.after_write"].skip == 2
    with pytest.raises(ValueError, match="counts hits from 1"):
        failpoints.parse("checkpoint.after_write=kill@0")
    failpoints.arm("checkpoint.after_write", "raise", times=1, skip=2)
    failpoints.hit("checkpoint.after_write")
    failpoints.hit("checkpoint.after_write")
    with pytest.raises(failpoints.FailPointError):
        failpoints.hit("checkpoint.after_write")
    failpoints.hit("checkpoint.after_write")  # spent


def test_hold_blocks_the_hitting_thread_until_released():
    import threading

    failpoints.arm("run.op", "hold", times=1)
    assert failpoints.pending("run.op")
    done = threading.Event()
    worker = threading.Thread(target=lambda: (failpoints.hit("run.op"), done.set()))
    worker.start()
    for _ in range(500):
        if not failpoints.pending("run.op"):
            break
        threading.Event().wait(0.01)
    assert not failpoints.pending("run.op") and not done.wait(0.2)  # caught and held
    failpoints.release("run.op")
    assert done.wait(5)
    worker.join()
    failpoints.hit("run.op")  # released means disarmed: a later hit passes
    with pytest.raises(ValueError, match="unknown fail point"):
        failpoints.release("run.nope")


def test_a_point_armed_for_a_key_fires_only_at_hits_with_that_key():
    """One request's failure at a point that every request passes (its sequence id as key)."""
    failpoints.arm("sampler.decode_request", "raise", times=1, key="bob")
    try:
        failpoints.hit("sampler.decode_request", key="alice-0")  # not bob's: passes, uncounted
        failpoints.hit("sampler.decode_request")  # no key: passes
        with pytest.raises(failpoints.FailPointError, match="sampler.decode_request"):
            failpoints.hit("sampler.decode_request", key="bob-1")
        failpoints.hit("sampler.decode_request", key="bob-1")  # *1: fired once
    finally:
        failpoints.disarm()
