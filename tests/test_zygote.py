"""helpers.zygote: `ember` commands forked from a pre-imported process behave like `python -m
ember.cli` processes (exit status, output, signals, environment, address-space cap)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from helpers.cli import run_cli
from helpers.server import server_env
from helpers.zygote import Zygote

pytestmark = pytest.mark.slow  # a zygote imports torch, transformers and ember's server once


@pytest.fixture(scope="module")
def zygote():
    zygote = Zygote.shared(server_env())
    if zygote is None:
        pytest.fail("the zygote refused to start (a thread after its imports?)")
    return zygote


def fork(zygote, tmp_path, argv, env=None, cap=None):
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    out.touch()
    proc = zygote.spawn(argv, cwd=tmp_path, env={**server_env(), **(env or {})}, stdout=out, stderr=err,
                        address_space_cap=cap)
    return proc, out, err


def test_a_forked_command_prints_and_exits_like_the_command(zygote, tmp_path):
    proc, out, err = fork(zygote, tmp_path, ["limits", "--markdown"])
    assert proc.wait(120) == 0, err.read_text()
    assert out.read_text() == run_cli("limits", "--markdown").stdout


def test_a_refused_flag_exits_2_with_the_parsers_message(zygote, tmp_path):
    proc, out, err = fork(zygote, tmp_path, ["serve", "--no-such-flag"])
    assert proc.wait(120) == 2
    assert "unrecognized arguments: --no-such-flag" in err.read_text()


def test_the_child_runs_in_its_own_directory(zygote, tmp_path):
    # (Its own environment is proven by the servers started with EMBER_FAILPOINTS set: the
    # crash, quota and operator tests fail unless the fail point reaches the child.)
    proc, _, err = fork(zygote, tmp_path, ["tiny-model", "rel-model"])
    assert proc.wait(300) == 0, err.read_text()
    assert (tmp_path / "rel-model" / "config.json").is_file()


def serving(zygote, tiny_model_dir, tmp_path, cap=None):
    """A forked `ember serve` that has printed its address."""
    argv = ["serve", "--model", f"m={tiny_model_dir}", "--data-dir", str(tmp_path / "data"), "--port", "0"]
    proc, out, err = fork(zygote, tmp_path, argv, cap=cap)
    deadline = time.monotonic() + 120
    while "listening on" not in out.read_text():  # a live server, not one that already ended
        assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-2000:]
        time.sleep(0.2)
    return proc


def test_signals_reach_the_child_and_its_status_is_minus_the_signal(zygote, tiny_model_dir, tmp_path):
    proc = serving(zygote, tiny_model_dir, tmp_path)
    proc.kill()
    assert proc.wait(30) == -signal.SIGKILL
    proc.kill()  # a reaped child is never signalled again (its pid may be another process's)


def test_the_address_space_cap_is_the_childs_limit(zygote, tiny_model_dir, tmp_path):
    cap = 16 << 30  # what memory_cap(16 << 30) gives `prlimit --as`
    proc = serving(zygote, tiny_model_dir, tmp_path, cap=cap)
    try:
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        row = next(line for line in limits.splitlines() if line.startswith("Max address space"))
        assert row.split()[3:5] == [str(cap), str(cap)], row
    finally:
        proc.terminate()
        assert proc.wait(30) in (0, -signal.SIGTERM)
