"""A pre-imported process that forks `ember` commands for the tests (a "zygote").

Starting `ember serve` costs 7-10 s of CPU, nearly all of it imports (torch, transformers,
peft, tinker, FastAPI, SQLAlchemy), and the suite starts dozens of servers on a 2-core
machine. The zygote imports those modules once per pytest worker; each start is then a
`fork` of it that runs `python -m ember.cli ARGV` through `runpy`, exactly as `-m` does,
in its own working directory, environment and output files. The child is a real process
running the real command; only the imports are inherited.

    zygote = Zygote.shared()                      # one per pytest worker, started on first use
    proc = zygote.spawn(["serve", ...], cwd=..., env=..., stdout=fifo_path, stderr=path)
    proc.poll(); proc.terminate(); proc.wait(20); proc.returncode   # like subprocess.Popen

Forking is safe here because the zygote has only imported modules: it has one thread and
has run no torch op (so no OpenMP pool exists), which `start` checks. What cannot go
through a fork starts the usual way (`helpers.server.start_server` decides): a wrapper
command (`prlimit`), a script, or tests of start-up itself.

Protocol (one JSON object per line): the test process writes a request on the zygote's
stdin, the zygote answers `{"id", "pid"}` once forked and `{"pid", "status"}` when it has
reaped a child (`status` as `Popen.returncode`: the exit code, or minus the signal).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

PRELOAD = ("torch", "transformers", "peft", "tinker", "fastapi", "uvicorn", "sqlalchemy",
           "ember.server.app", "ember.service", "ember.engine", "ember.models")


class ZygoteProc:
    """A forked child, as much of `subprocess.Popen` as the tests use."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid, self.returncode = zygote, pid, None
        self.stdout = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.status(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        status = self.zygote.wait(self.pid, timeout)
        if status is None:
            raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout)
        self.returncode = status
        return status

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a reaped pid: it may belong to another process now
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    _shared: Zygote | None = None
    _shared_lock = threading.Lock()

    def __init__(self, proc: subprocess.Popen, env: Mapping[str, str]) -> None:
        self.proc, self.env = proc, dict(env)
        self._lock = threading.Lock()
        self._done = threading.Condition()
        self._statuses: dict[int, int] = {}
        self._forked: dict[int, int] = {}
        self._next_id = 0
        self._alive = True
        threading.Thread(target=self._read, daemon=True).start()

    @classmethod
    def shared(cls, env: Mapping[str, str]) -> Zygote | None:
        """This process's zygote (started with `env` on first use), or None when it cannot run."""
        with cls._shared_lock:
            if cls._shared is not None and cls._shared.alive():
                return cls._shared
            cls._shared = cls.start(env)
            return cls._shared

    @classmethod
    def start(cls, env: Mapping[str, str]) -> Zygote | None:
        proc = subprocess.Popen([sys.executable, "-m", "helpers.zygote"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=dict(env))
        ready = proc.stdout.readline()
        if not ready.startswith('{"ready"'):
            proc.kill()
            proc.wait(10)
            return None
        zygote = cls(proc, env)
        atexit.register(zygote.close)
        return zygote

    def alive(self) -> bool:
        return self._alive and self.proc.poll() is None

    def spawn(self, argv: Sequence[str], *, cwd: Path | None, env: Mapping[str, str],
              stdout: Path, stderr: Path, address_space_cap: int | None = None,
              module: str = "ember.cli") -> ZygoteProc:
        """Fork `python -m MODULE ARGV` with stdin from /dev/null and stdout/stderr opened
        (for writing) at the given paths (`stdout` may be a FIFO the caller reads), and
        RLIMIT_AS set to `address_space_cap` bytes if given (what `prlimit --as` does)."""
        with self._lock:
            self._next_id += 1
            request = {"id": self._next_id, "module": module, "argv": list(argv), "cwd": str(cwd) if cwd else None,
                       "env": dict(env), "stdout": str(stdout), "stderr": str(stderr),
                       "address_space_cap": address_space_cap}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            request_id = self._next_id
        with self._done:
            if not self._done.wait_for(lambda: request_id in self._forked or not self._alive, timeout=60):
                raise RuntimeError("the zygote did not fork in 60 s")
            if request_id not in self._forked:
                raise RuntimeError("the zygote died")
            return ZygoteProc(self, self._forked.pop(request_id))

    def status(self, pid: int) -> int | None:
        with self._done:
            return self._statuses.get(pid)

    def wait(self, pid: int, timeout: float | None) -> int | None:
        with self._done:
            self._done.wait_for(lambda: pid in self._statuses or not self._alive, timeout=timeout)
            return self._statuses.get(pid)

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            with self._done:
                if "status" in message:
                    self._statuses[message["pid"]] = message["status"]
                else:
                    self._forked[message["id"]] = message["pid"]
                self._done.notify_all()
        with self._done:
            self._alive = False
            self._done.notify_all()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def run_module(module: str, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str],
               timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run([python, "-m", module, *argv], capture_output=True, text=True)`, forked
    from this worker's zygote (its imports spared) when one runs, else exactly that."""
    zygote = Zygote.shared(env)
    if zygote is None:
        return subprocess.run([sys.executable, "-m", module, *argv], cwd=cwd, env=dict(env),
                              capture_output=True, text=True, timeout=timeout)
    out, err = (Path(cwd) / f".{module}-{time.time_ns()}.{name}" for name in ("out", "err"))
    out.touch()
    proc = zygote.spawn(argv, cwd=cwd, env=env, stdout=out, stderr=err, module=module)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
        raise
    return subprocess.CompletedProcess([module, *argv], code, out.read_text(), err.read_text())


# ---------------------------------------------------------------- the zygote process


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _say(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()  # nothing stays buffered to be copied into a child at the next fork


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say({"pid": pid, "status": _returncode(status)})


def _become(request: dict) -> int:
    """In the forked child: run `python -m MODULE ARGV` as `-m` would; its exit code."""
    import runpy

    if request["cwd"]:
        os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    if request["address_space_cap"]:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (request["address_space_cap"],) * 2)
    sys.argv = [request["module"], *request["argv"]]
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return 0


def _end(code: int) -> None:
    """End a child (or the zygote) the way multiprocessing ends its forked children (`Process._bootstrap`):
    non-daemon threads joined, exit handlers run, output flushed, then `os._exit`. A full
    interpreter finalization would tear down every inherited module, copying most of the
    zygote's memory page by page for nothing (seconds per child on a loaded machine)."""
    try:
        threading._shutdown()  # noqa: SLF001 (what interpreter exit and multiprocessing call)
        atexit._run_exitfuncs()  # noqa: SLF001
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def serve_forks() -> None:
    """The zygote's main loop, one thread: preload, then fork one child per request line on
    stdin, and report each child's end. A child never returns into the loop (`_end`)."""
    import gc
    import importlib
    import select

    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:  # an import started a thread: forking would be unsafe
        _say({"refused": f"{threading.active_count()} threads after the imports"})
        return
    gc.freeze()  # the imports' objects: no collection in a child touches (and so copies) them
    _say({"ready": True})
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.2)
        _reap()
        if not readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:  # the test process closed our stdin: its children are its business
            _end(0)  # no teardown of the imports (triton's bindings report "leaks" at one)
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                try:
                    code = _become(request)
                except BaseException:  # noqa: BLE001 (as an uncaught exception ends `python -m`)
                    traceback.print_exc()
                    code = 1
                _end(code)
            _say({"id": request["id"], "pid": pid})


if __name__ == "__main__":
    serve_forks()
