"""helpers.zygote: `ember` commands forked from a pre-imported process behave like `python -m
ember.cli` processes (exit status, output, signals, environment, address-space cap), a forked
script like `python SCRIPT`, and a shim on PATH like the executable it stands for (argv,
working directory, environment, stdin/stdout, exit status, SIGTERM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.cli import run_cli
from helpers.server import server_env, wait_until
from helpers.zygote import Zygote, write_shims

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
    def listening() -> bool:  # a live server, not one that already ended
        assert proc.poll() is None, err.read_text()[-2000:]
        return "listening on" in out.read_text()

    wait_until(listening, 120, message="the forked server's address")
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


SCRIPT = """\
import os, signal, sys, time
print("argv", sys.argv[1:], "path0", sys.path[0], "cwd", os.getcwd(), "env", os.environ.get("ZYGOTE_TEST"))
print("stdin", sys.stdin.read().upper(), flush=True)
print("to stderr", file=sys.stderr)
if sys.argv[1] == "sleep":  # until a SIGTERM, which it answers with exit code 7
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    open(sys.argv[2], "w").write(str(os.getpid()))
    time.sleep(600)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def shims(zygote, tmp_path_factory):
    return write_shims(zygote, tmp_path_factory.mktemp("shims"))


def script(tmp_path) -> Path:
    path = tmp_path / "bin" / "probe.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(SCRIPT)
    return path


def test_a_forked_script_prints_and_exits_like_python_running_it(zygote, tmp_path):
    probe, env = script(tmp_path), {**server_env(), "ZYGOTE_TEST": "x"}
    out = tmp_path / "out.txt"
    out.touch()
    proc = zygote.spawn(["3", "a b"], cwd=tmp_path, env=env, stdout=out, stderr=out, script=probe)
    assert proc.wait(60) == 3
    done = subprocess.run([sys.executable, str(probe), "3", "a b"], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    assert done.returncode == 3
    assert out.read_text() == done.stdout
    assert f"path0 {probe.parent}" in done.stdout  # (what the forked script must match)


def shell(command: str, shims: Path | None, cwd: Path, stdin: str = "") -> subprocess.CompletedProcess:
    path = os.pathsep.join([*([str(shims)] if shims else []), str(Path(sys.executable).parent), os.environ["PATH"]])
    env = {**server_env(), "PATH": path, "ZYGOTE_TEST": "y"}
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, input=stdin, capture_output=True, text=True,
                          timeout=120)


def test_a_shim_passes_argv_cwd_env_stdin_stdout_and_the_exit_code(shims, tmp_path):
    script(tmp_path)
    command = ("python bin/probe.py 5 'two words' | tr a-z A-Z; echo rc=${PIPESTATUS[0]};"
               " echo sub=$(python bin/probe.py 0 </dev/null | wc -l)")
    forked, execd = (shell(command, d, tmp_path, stdin="from stdin") for d in (shims, None))
    assert forked.returncode == execd.returncode == 0, forked.stderr
    assert forked.stdout == execd.stdout
    assert "STDIN FROM STDIN" in forked.stdout and "RC=5" in forked.stdout.upper() and "sub=2" in forked.stdout
    assert forked.stderr == execd.stderr == "to stderr\nto stderr\n"


def test_an_ember_shim_runs_the_console_script(shims, tmp_path):
    forked, execd = (shell("ember serve --no-such-flag", d, tmp_path) for d in (shims, None))
    assert forked.returncode == execd.returncode == 2
    assert forked.stderr == execd.stderr and "unrecognized arguments: --no-such-flag" in forked.stderr
    forked, execd = (shell("ember limits --markdown", d, tmp_path) for d in (shims, None))
    assert forked.returncode == 0 and forked.stdout == execd.stdout


def test_a_shim_forwards_sigterm_and_exits_with_its_commands_status(shims, tmp_path):
    probe, pid_file = script(tmp_path), tmp_path / "pid"
    proc = subprocess.Popen([str(shims / "python"), str(probe), "sleep", str(pid_file)], cwd=tmp_path,
                            env=server_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            start_new_session=True)
    def started() -> bool:
        assert proc.poll() is None
        return pid_file.exists() and bool(pid_file.read_text())

    wait_until(started, 60, interval=0.1, message="the probe's pid file")
    child = int(pid_file.read_text())
    assert child != proc.pid  # the command is the zygote's fork, not the shim
    os.killpg(proc.pid, signal.SIGTERM)  # as the README test stops a block's process group
    assert proc.wait(60) == 7  # the command's own SIGTERM handler ran, and its code came back
    assert not Path(f"/proc/{child}").exists()
