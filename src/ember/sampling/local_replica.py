"""`LocalReplica`: a sampler replica in its own process on this machine (placement "local").

The process forks from multiprocessing's forkserver (`ember.forkserver`: no inherited
threads, CUDA state or locks, and torch, transformers and the sampler already imported)
and runs a `ReplicaHost` on its device. Calls travel over one
`multiprocessing` pipe as `(request id, op, args)`; answers come back as
`(request id, ok, payload)`, matched to their Future by a reader thread. Neither side
ever blocks on the other: the pool's side sends from its own thread (a stopped replica
fills the pipe, not a caller's stack), and the replica answers `ping` and `follow` on
its reading thread, samples when their Futures resolve, and runs the other ops on one worker thread,
so a long weight load never delays a ping or a sample.

A replica whose pipe closes (the process died) fails every pending call at once with
`ReplicaFailed`; the pool decides the rest (ember.sampling.pool). The replica exits when
the pool's end of the pipe closes, so a killed server leaves no replica behind.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ember import forkserver
from ember.errors import UserError
from ember.sampling.config import SamplerConfig
from ember.sampling.replica import Replica, ReplicaError, ReplicaFailed

log = logging.getLogger(__name__)
_STOP = object()


class LocalReplica(Replica):
    def __init__(self, index: int, process, conn) -> None:
        self.index = index
        self._process, self._conn = process, conn
        self._ids = itertools.count(1)
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._dead: str | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, name=f"ember-replica-{index}-read", daemon=True).start()
        threading.Thread(target=self._write, name=f"ember-replica-{index}-write", daemon=True).start()

    @classmethod
    def start(cls, index: int, model_dir: str, config: SamplerConfig, scratch_dir: str | None) -> "LocalReplica":
        ctx = forkserver.context()
        ours, theirs = ctx.Pipe(duplex=True)
        # Not daemonic: a replica's backend may start processes of its own (vLLM's engine core).
        process = ctx.Process(target=serve_replica, args=(theirs, str(model_dir), config, scratch_dir),
                              name=f"ember-sampler-replica-{index}", daemon=False)
        process.start()
        theirs.close()
        return cls(index, process, ours)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def call(self, op: str, *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._dead is not None:
                future.set_exception(ReplicaFailed(self._dead))
                return future
            rid = next(self._ids)
            self._pending[rid] = future
        self._outbox.put((rid, op, args))
        return future

    def alive(self) -> bool:
        return self._dead is None and self._process.is_alive()

    def kill(self) -> None:
        self._fail(f"sampler replica {self.index} was stopped")
        if self._process.is_alive():
            self._process.kill()
        self._process.join(timeout=30)

    # ------------------------------------------------------------------ internals
    def _fail(self, reason: str) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = reason
            pending, self._pending = self._pending, {}
        self._outbox.put(_STOP)
        for future in pending.values():
            if not future.done():
                future.set_exception(ReplicaFailed(reason))
        try:
            self._conn.close()
        except OSError:
            pass

    def _write(self) -> None:
        while (message := self._outbox.get()) is not _STOP:
            try:
                self._conn.send(message)
            except (OSError, ValueError) as exc:  # the pipe is gone: the reader reports the death
                self._fail(f"sampler replica {self.index}: sending failed ({exc})")
                return

    def _read(self) -> None:
        while True:
            try:
                rid, ok, payload = self._conn.recv()
            except (EOFError, OSError, ValueError):
                self._process.join(timeout=5)
                self._fail(f"sampler replica {self.index} (pid {self._process.pid}) exited "
                           f"(exit code {self._process.exitcode})")
                return
            with self._lock:
                future = self._pending.pop(rid, None)
            if future is not None and not future.done():
                future.set_result(payload) if ok else future.set_exception(_error(payload))


def _error(payload: tuple[str, str]) -> Exception:
    kind, message = payload
    return UserError(message) if kind == "user" else ReplicaError(message)


def _encode(exc: BaseException) -> tuple[str, str]:
    """An exception as (kind, message): only the category and the text cross the pipe."""
    if isinstance(exc, UserError):  # the caller's input: its type must survive the pipe (category user)
        return "user", str(exc)
    return "error", str(exc) if isinstance(exc, (ReplicaError, RuntimeError)) else f"{type(exc).__name__}: {exc}"


def serve_replica(conn, model_dir: str, config: SamplerConfig, scratch_dir: str | None) -> None:
    """The replica process: build the host, then answer calls until the pipe closes."""
    from ember.sampling.replica import ReplicaHost

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s replica[{os.getpid()}] %(levelname)s %(message)s")
    send_lock = threading.Lock()

    def send(message) -> None:
        with send_lock:
            try:
                conn.send(message)
            except (OSError, ValueError):
                pass  # the pool is gone; the read loop ends too

    try:
        host, failure = ReplicaHost(model_dir, config, scratch_dir), None
    except Exception as exc:  # noqa: BLE001 - reported to the pool as the answer to every call
        log.exception("the replica's sampler could not start")
        host, failure = None, ("user" if isinstance(exc, UserError) else "error",
                               f"the sampler replica could not start: {type(exc).__name__}: {exc}")
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ember-replica-ops")
    closed = _serve_loop(conn, host, failure, send, worker)
    if host is not None and not closed:
        host.close()
    os._exit(0)  # without waiting for the backend's non-daemon threads: the pool is gone


def _serve_loop(conn, host, failure, send, worker) -> bool:
    """Answer calls until the pipe closes (False) or the pool sends `close` (True)."""
    while True:
        try:
            rid, op, args = conn.recv()
        except (EOFError, OSError):
            return False
        if failure is not None:
            send((rid, False, failure))
            continue
        if op == "ping":
            send((rid, True, host.ping()))
        elif op == "sample":
            _start_sample(host, rid, args, send)
        elif op == "follow":  # adopted between decode steps: never queued behind a weight load
            _run_op(host, rid, op, args, send)
        elif op == "close":
            worker.shutdown(wait=True)
            host.close()
            send((rid, True, None))
            return True
        else:
            worker.submit(_run_op, host, rid, op, args, send)


def _start_sample(host, rid: int, args, send) -> None:
    try:
        future = host.sample(*args)
    except Exception as exc:  # noqa: BLE001 - this request's failure, reported to it
        send((rid, False, _encode(exc)))
        return

    def done(f: Future) -> None:
        exc = f.exception()
        send((rid, False, _encode(exc)) if exc is not None else (rid, True, f.result()))

    future.add_done_callback(done)


def _run_op(host, rid: int, op: str, args, send) -> None:
    method = getattr(host, op, None) if not op.startswith("_") else None
    if method is None:
        send((rid, False, ("error", f"unknown replica op {op!r}")))
        return
    try:
        send((rid, True, method(*args)))
    except Exception as exc:  # noqa: BLE001 - the op's failure, reported to its caller
        if not isinstance(exc, UserError):  # a UserError is the caller's input, reported to it alone
            log.exception("replica op %s failed", op)
        send((rid, False, _encode(exc)))
