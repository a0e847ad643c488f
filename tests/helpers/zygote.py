"""A pre-imported process that forks `ember` commands for the tests (a "zygote").

Starting `ember serve` costs 7-10 s of CPU, nearly all of it imports (torch, transformers,
peft, tinker, FastAPI, SQLAlchemy), and the suite starts dozens of servers on a 2-core
machine. The zygote imports those modules once per pytest worker; each start is then a
`fork` of it that runs `python -m ember.cli ARGV` through `runpy`, exactly as `-m` does,
in its own working directory, environment and output files. The child is a real process
running the real command; only the imports are inherited. A script (`python SCRIPT ARGV`)
runs the same way through `runpy.run_path`.

    zygote = Zygote.shared()                      # one per pytest worker, started on first use
    proc = zygote.spawn(["serve", ...], cwd=..., env=..., stdout=fifo_path, stderr=path)
    proc.poll(); proc.terminate(); proc.wait(20); proc.returncode   # like subprocess.Popen
    write_shims(zygote, bin_dir)                  # `ember`, `tinker`, `python` forked from a shell

A shim (`helpers/zygote_shim.py`, written into a directory put first on PATH) is a small
executable that starts in milliseconds: it hands the zygote its argv, working directory,
environment and its stdin/stdout/stderr (`socket.send_fds` over the zygote's Unix socket),
the zygote forks the command with those, and the shim forwards SIGTERM/SIGINT/SIGHUP to it
and exits with its status, so a shell (`cmd | tee`, `$(cmd)`, `cmd &`) sees the command itself.

Forking is safe here because the zygote has only imported modules: it has one thread and
has run no torch op (so no OpenMP pool exists), which `start` checks. What cannot go
through a fork starts the usual way (`helpers.server.start_server` decides): a wrapper
command other than `memory_cap`'s `prlimit` (the child sets that limit on itself), or tests
of start-up itself.

Protocol (one JSON object per line): the test process writes a request on the zygote's
stdin, the zygote answers `{"id", "pid"}` once forked and `{"pid", "status"}` when it has
reaped a child (`status` as `Popen.returncode`: the exit code, or minus the signal). A shim's
connection carries its three file descriptors and one request line, then the zygote writes
`{"pid"}` and finally `{"status"}`, and the shim may write `{"signal": n}` lines in between;
a shim that goes away before its command ends leaves it a SIGTERM.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

# EMBER_TEST_FORK=0 turns every fork off: each command is exec'd as a user runs it
FORK = os.environ.get("EMBER_TEST_FORK", "1") != "0"
SHIM = Path(__file__).with_name("zygote_shim.py")

# ember's modules by name: its packages' __init__s import nothing (`ember.registry.lazy_exports`)
PRELOAD = ("torch", "transformers", "peft", "tinker", "fastapi", "uvicorn", "sqlalchemy",
           "ember.server.app", "ember.service.core", "ember.engine.torch_engine", "ember.models.adapter",
           "ember.metrics.logger", "ember.metrics.config", "ember.sampling.registry")


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

    def __init__(self, proc: subprocess.Popen, env: Mapping[str, str], socket_path: str) -> None:
        self.proc, self.env, self.socket_path = proc, dict(env), socket_path
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
        zygote = cls(proc, env, json.loads(ready)["socket"])
        atexit.register(zygote.close)
        return zygote

    def alive(self) -> bool:
        return self._alive and self.proc.poll() is None

    def spawn(self, argv: Sequence[str], *, cwd: Path | None, env: Mapping[str, str],
              stdout: Path, stderr: Path, address_space_cap: int | None = None,
              module: str = "ember.cli", script: Path | None = None) -> ZygoteProc:
        """Fork `python -m MODULE ARGV` (or `python SCRIPT ARGV`) with stdin from /dev/null and
        stdout/stderr opened (for writing) at the given paths (`stdout` may be a FIFO the caller
        reads; `stderr` the same path shares its file), and RLIMIT_AS set to
        `address_space_cap` bytes if given (what `prlimit --as` does)."""
        target = {"script": str(script)} if script else {"module": module}
        with self._lock:
            self._next_id += 1
            request = {"id": self._next_id, **target, "argv": list(argv), "cwd": str(cwd) if cwd else None,
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
                self.proc.wait(30)  # its shims' commands get up to 20 s to end (`_end_shims`)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def run_module(module: str, argv: Sequence[str], *, cwd: Path | None = None, env: Mapping[str, str],
               timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run([python, "-m", module, *argv], capture_output=True, text=True)`, forked
    from this worker's zygote (its imports spared) when one runs, else exactly that."""
    zygote = Zygote.shared(env) if FORK else None
    if zygote is None:
        return subprocess.run([sys.executable, "-m", module, *argv], cwd=cwd, env=dict(env),
                              capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="ember-run-") as captured:
        out, err = Path(captured) / "out", Path(captured) / "err"
        out.touch()
        proc = zygote.spawn(argv, cwd=cwd, env=env, stdout=out, stderr=err, module=module)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
            raise
        return subprocess.CompletedProcess([module, *argv], code, out.read_text(), err.read_text())


def write_shims(zygote: Zygote, directory: Path) -> Path:
    """Write `ember`, `tinker` and `python` shims (helpers/zygote_shim.py) forking from `zygote`
    into `directory`, to be put first on a shell's PATH. `ember`/`tinker` run the venv's console
    script file, as its own `#!python` would; `python SCRIPT ...` and `python -m MODULE ...` fork
    and any other `python` command line is exec'd. A shim whose zygote has ended execs too."""
    directory.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    for name in ("ember", "tinker", "python"):
        script = Path(python).with_name(name)
        config = {"socket": zygote.socket_path, "python": python,
                  "script": None if name == "python" else str(script)}
        if name != "python" and not script.is_file():
            continue
        shim = directory / name
        shim.write_text(f"#!{python} -IS\nCONFIG = {config!r}\n{SHIM.read_text()}")
        shim.chmod(0o755)
    return directory


# ---------------------------------------------------------------- the zygote process



def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _say(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()  # nothing stays buffered to be copied into a child at the next fork


class _Shims:
    """The zygote's side of the shims' connections: which child each one waits for."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="ember-zygote-")  # a short path: AF_UNIX allows 108 bytes
        self.path = os.path.join(self.directory, "socket")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(64)
        self.by_pid: dict[int, socket.socket] = {}
        self.by_conn: dict[socket.socket, int] = {}

    def sockets(self) -> list[socket.socket]:
        return [self.listener, *self.by_conn]

    def accept(self) -> tuple[socket.socket, dict, list[int]] | None:
        """A shim's connection, its request and its stdin/stdout/stderr; None if it went away."""
        conn, _ = self.listener.accept()
        conn.settimeout(30)  # a shim sends everything at once: a stall here is a dead shim
        try:
            _, fds, _, _ = socket.recv_fds(conn, 1, 3)
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(1 << 20)
                if not chunk:
                    raise ConnectionError("the shim closed its connection mid-request")
                data += chunk
        except OSError:
            conn.close()
            return None
        conn.settimeout(None)
        return conn, json.loads(data), fds

    def started(self, conn: socket.socket, pid: int) -> None:
        self.by_pid[pid], self.by_conn[conn] = conn, pid
        self._send(conn, {"pid": pid})

    def ended(self, pid: int, code: int) -> bool:
        """Tell the shim waiting for `pid` its status; False when no shim waits for it."""
        conn = self.by_pid.pop(pid, None)
        if conn is None:
            return False
        self._send(conn, {"status": code})
        self._drop(conn)
        return True

    def message(self, conn: socket.socket) -> None:
        """A shim's `{"signal": n}` lines go to its child; a shim gone leaves the child a SIGTERM."""
        pid = self.by_conn[conn]  # not yet reaped (`ended` drops the connection): not reused
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        lines = [line for line in data.splitlines() if line.strip()]
        signals = [json.loads(line)["signal"] for line in lines] if data else [signal.SIGTERM]
        for sig in signals:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if not data:
            self.by_pid.pop(pid, None)
            self._drop(conn)

    def close_in_child(self) -> None:
        for sock in self.sockets():
            sock.close()

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def _send(self, conn: socket.socket, message: dict) -> None:
        try:
            conn.sendall(json.dumps(message).encode() + b"\n")
        except OSError:
            pass  # the shim went away: `message` sees its end

    def _drop(self, conn: socket.socket) -> None:
        self.by_conn.pop(conn, None)
        conn.close()


def _reap(shims: _Shims) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if not shims.ended(pid, _returncode(status)):
            _say({"pid": pid, "status": _returncode(status)})


def _end_shims(shims: _Shims, timeout: float = 20.0) -> None:
    """A shim's command gets a SIGTERM when the zygote ends (its shim could no longer learn
    its status), and its status reaches the shim if it ends within `timeout` s."""
    for pid in list(shims.by_pid):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while shims.by_pid and time.monotonic() < deadline:
        _reap(shims)
        time.sleep(0.05)
    shims.remove()


def _redirect(request: dict, fds: Sequence[int] | None) -> None:
    """stdin/stdout/stderr: a shim's own, or /dev/null and the request's paths."""
    if fds is None:
        paths = ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                 (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND))
        fds = [os.open(path, flags, 0o644) for _, path, flags in paths]
        if request["stderr"] == request["stdout"]:  # one file, one offset (`stderr=STDOUT`)
            os.close(fds[2])
            fds[2] = os.dup(fds[1])
    for fd, opened in enumerate(fds):
        os.dup2(opened, fd)
    for opened in fds:
        if opened > 2:
            os.close(opened)


def _become(request: dict, fds: Sequence[int] | None = None) -> int:
    """In the forked child: run `python -m MODULE ARGV` or `python SCRIPT ARGV` as python would;
    its exit code."""
    import runpy

    if request["cwd"]:
        os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _redirect(request, fds)
    if request.get("address_space_cap"):
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (request["address_space_cap"],) * 2)
    try:
        if "script" in request:  # sys.path[0] is the script's directory, as `python SCRIPT` sets it
            sys.path[0] = os.path.dirname(os.path.realpath(request["script"]))
            sys.argv = [request["script"], *request["argv"]]
            runpy.run_path(request["script"], run_name="__main__")
        else:  # sys.path[0] is the working directory, as `python -m` sets it
            sys.path[0] = os.getcwd()
            sys.argv = [request["module"], *request["argv"]]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(exit_.code, file=sys.stderr)  # `sys.exit("message")`, as the interpreter prints it
        return 1
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


def _fork(request: dict, shims: _Shims, fds: Sequence[int] | None = None) -> int:
    """Fork a child running `request`; the child never returns into the loop (`_end`)."""
    pid = os.fork()
    if pid == 0:
        try:
            shims.close_in_child()
            code = _become(request, fds)
        except BaseException:  # noqa: BLE001 (as an uncaught exception ends `python -m`)
            traceback.print_exc()
            code = 1
        _end(code)
    return pid


def _serve_shim(shims: _Shims) -> None:
    accepted = shims.accept()
    if accepted is None:
        return
    conn, request, fds = accepted
    try:
        shims.started(conn, _fork(request, shims, fds))
    finally:
        for fd in fds:
            os.close(fd)


def serve_forks() -> None:
    """The zygote's main loop, one thread: preload, then fork one child per request line on
    stdin or per shim connection, and report each child's end."""
    import gc
    import importlib
    import select

    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:  # an import started a thread: forking would be unsafe
        _say({"refused": f"{threading.active_count()} threads after the imports"})
        return
    gc.freeze()  # the imports' objects: no collection in a child touches (and so copies) them
    shims = _Shims()
    _say({"ready": True, "socket": shims.path})
    pending = b""
    while True:
        readable, _, _ = select.select([0, *shims.sockets()], [], [], 0.2)
        _reap(shims)
        for source in readable:
            if source is shims.listener:
                _serve_shim(shims)
            elif source != 0 and source in shims.by_conn:  # (not one `_reap` just answered)
                shims.message(source)
        if 0 not in readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:  # the test process closed our stdin: its children are its business
            _end_shims(shims)
            _end(0)  # no teardown of the imports (triton's bindings report "leaks" at one)
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            _say({"id": request["id"], "pid": _fork(request, shims)})


if __name__ == "__main__":
    serve_forks()
