"""Run an `ember` subcommand in this process, as `subprocess.run([... "ember.cli", ...])` would.

A fresh `python -m ember.cli` pays the interpreter's and torch's start-up (seconds alone,
minutes on a loaded 2-core machine) for commands that then run in milliseconds; tests of a
command's output and exit status run it here instead. Tests of what only a separate
process shows (its own CPU time, a server refusing to start) keep `subprocess`.

    r = run_cli("estimate", "--model", str(model_dir), "--tokens", "0")
    assert r.returncode == 2 and "tokens must be" in r.stderr
"""

from __future__ import annotations

import contextlib
import io
import subprocess


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`ember.cli.main(args)` with its stdout/stderr captured; argparse's exit is its status."""
    from ember.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse refusing an argument: status 2, its message on stderr
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(["ember", *args], code, out.getvalue(), err.getvalue())
