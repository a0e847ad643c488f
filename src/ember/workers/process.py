"""`process` runtime: N local processes joined by torch.distributed (gloo on CPU, NCCL on GPU).

Ranks are started through multiprocessing's *forkserver* (`ember.forkserver`): the server
imports torch, transformers and ember once (`preload`), then every rank is a cheap fork of
that clean, single-threaded process (a plain fork of the caller would inherit its threads;
a spawn would pay the imports again per rank). They rendezvous on `tcp://127.0.0.1:<free port>`.

Each rank talks to the caller over its own pipe (pickled `Request`/`Reply` bytes).
Liveness without heartbeats that could be missed: the caller waits on the pipes *and* the
processes' sentinels at once, so a rank that dies (even `kill -9` mid-collective) is seen
within milliseconds and raises `WorkerDiedError`; a call that outlives its timeout raises
`WorkerTimeoutError`. Either way the surviving ranks are killed (they may be blocked in a
collective that can never complete). In the other direction each rank runs a watchdog
thread that exits the rank when the caller's process is gone, so no orphan survives a
crashed caller.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
from typing import Any

from ember import forkserver
from ember.workers.remote import RemoteRuntime, answer, dumps, pid_alive
from ember.workers.runtime import (RankContext, Reply, Request, WorkerDiedError, WorkerError, check_device_count,
                                  free_port, init_rank_process)

DEFAULT_PRELOAD = forkserver.PRELOAD


def _watchdog(caller_pid: int, period_s: float = 1.0) -> None:
    def loop() -> None:
        while pid_alive(caller_pid):
            time.sleep(period_s)
        os._exit(3)  # the caller is gone: never leave an orphan rank behind

    threading.Thread(target=loop, name="ember-watchdog", daemon=True).start()


def _serve(conn, worker) -> None:
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        payload = answer(worker, data)
        if payload is None:
            return
        conn.send_bytes(payload)


def _child_main(conn, ctx: RankContext, addr: str, port: int, threads: int, pg_timeout_s: float, caller_pid: int):
    _watchdog(caller_pid)
    try:
        init_rank_process(ctx, addr, port, threads, pg_timeout_s)
        from ember.workers.worker import RankWorker

        worker = RankWorker(ctx)
    except BaseException as exc:  # noqa: BLE001
        conn.send_bytes(dumps(Reply.failure(ctx.rank, exc)))
        return
    conn.send_bytes(dumps(Reply(rank=ctx.rank, ok=True, value="ready")))
    try:
        _serve(conn, worker)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "is unresponsive"
    if code < 0:
        try:
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class ProcessRuntime(RemoteRuntime):
    name = "process"

    def __init__(
        self,
        world_size: int = 1,
        device: str = "cpu",
        *,
        start_method: str = "forkserver",
        preload: tuple[str, ...] = DEFAULT_PRELOAD,
        **rank_options: Any,
    ) -> None:
        """rank_options: `RemoteRuntime`'s (torch_threads, start_timeout_s, pg_timeout_s, failure_grace_s)."""
        super().__init__(world_size, device, **rank_options)
        if device == "cuda":  # rank r takes cuda:r of this machine
            import torch

            check_device_count(world_size, torch.cuda.device_count())
        self.start_method = start_method
        self.preload = preload
        self._procs: list[multiprocessing.Process] = []
        self._conns: list[multiprocessing.connection.Connection] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        last: Exception | None = None
        for _ in range(2):  # a second try covers a rendezvous port taken in between
            try:
                self._launch(free_port())
                return
            except WorkerError as exc:
                last = exc
                self.shutdown()
                self._broken = None
        raise WorkerError(f"could not start {self.world_size} ranks: {last}") from last

    def _launch(self, port: int) -> None:
        if self.start_method == "forkserver":
            mp = forkserver.context(self.preload)
        else:
            mp = multiprocessing.get_context(self.start_method)
        for rank in range(self.world_size):
            ctx = RankContext(rank, self.world_size, rank, self.device_type, self.backend)
            parent, child = mp.Pipe(duplex=True)
            args = (child, ctx, "127.0.0.1", port, self.torch_threads, self.pg_timeout_s, os.getpid())
            proc = mp.Process(target=_child_main, args=args, name=f"ember-rank{rank}", daemon=True)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        replies = self._collect(time.monotonic() + self.start_timeout_s, "start")
        failed = [r for r in replies if not r.ok]
        if failed:
            raise WorkerError(f"rank {failed[0].rank} failed to start: {failed[0].error}\n{failed[0].traceback}")

    def shutdown(self) -> None:
        for conn in self._conns:
            try:
                conn.send_bytes(dumps(Request(op="exit")))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._stop_ranks()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def _stop_ranks(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=5.0)

    def alive(self) -> list[bool]:
        return [p.is_alive() for p in self._procs]

    def pids(self) -> list[int]:
        return [int(p.pid) for p in self._procs]

    # ------------------------------------------------------------------ calls
    def execute(self, requests: list[Request], timeout_s: float) -> list[Reply]:
        self._check_callable(started=bool(self._procs))
        payloads = [dumps(req) for req in requests]  # all or none: a rank alone would block in a collective
        for rank, (conn, payload) in enumerate(zip(self._conns, payloads)):
            try:
                conn.send_bytes(payload)
            except (BrokenPipeError, ConnectionError, OSError):
                self._fail(WorkerDiedError, f"rank {rank} {_exit_reason(self._procs[rank].exitcode)}")
        return self._collect(time.monotonic() + timeout_s, f"call {requests[0].op}:{requests[0].method or ''}")

    def _collect(self, deadline: float, what: str) -> list[Reply]:
        pending = dict(enumerate(self._conns))
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        replies: dict[int, Reply] = {}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return self._out_of_time(replies, sorted(pending), what)
            ready = multiprocessing.connection.wait([*pending.values(), *sentinels], timeout=remaining)
            for rank, conn in list(pending.items()):
                if conn in ready:
                    try:
                        replies[rank] = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        continue  # the sentinel below tells why
                    del pending[rank]
                    deadline = self._deadline_after(replies[rank], deadline)
            for sentinel, rank in sentinels.items():
                if sentinel in ready:
                    self._procs[rank].join(timeout=1.0)
                    code = self._procs[rank].exitcode
                    self._fail(WorkerDiedError, f"{what}: rank {rank} (pid {self._procs[rank].pid}) {_exit_reason(code)}")
        return [replies[r] for r in range(self.world_size)]
