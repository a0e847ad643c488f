"""What the runtimes whose ranks are other processes (`process`, `ray`) share: the rank's
side of one call (`answer`) and the caller's rules for failures (`RemoteRuntime`).

The failure rules, written once:

* A call to a broken or stopped runtime is refused (`WorkerError`) before anything is sent.
* A rank that fails while others have not answered shortens the call's deadline to
  `failure_grace_s`: the others may be blocked forever in a collective the failed rank
  never joins.
* At the deadline, if some rank failed, the stuck ranks are stopped and every rank's
  reply comes back (the failure re-raises with its own type); if none failed, the call
  raises `WorkerTimeoutError`. A rank whose process died raises `WorkerDiedError`.
  Either way the group is broken and every rank is stopped.
"""

from __future__ import annotations

import abc
import os
import pickle
import time
from collections.abc import Mapping
from typing import Any, NoReturn

from ember.workers.runtime import Reply, Request, Runtime, WorkerError, WorkerTimeoutError


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def answer(worker, data: bytes) -> bytes | None:
    """A rank's pickled reply to one pickled request; None for `exit` (stop serving).

    A request that cannot be unpickled (an unimportable factory) or a result that cannot
    be pickled becomes a failed reply, never a dead rank."""
    try:
        req: Request = pickle.loads(data)
    except Exception as exc:
        return dumps(Reply.failure(worker.ctx.rank, exc))
    if req.op == "exit":
        return None
    reply = worker.handle(req)
    try:
        return dumps(reply)
    except Exception as exc:
        return dumps(Reply.failure(worker.ctx.rank, TypeError(f"result cannot be pickled: {exc}")))


def _failed(value: Any) -> bool:
    return isinstance(value, Reply) and not value.ok


class RemoteRuntime(Runtime):
    """A runtime of out-of-process ranks, with the failure rules of the module docstring."""

    def __init__(self, world_size: int, device: str, *, torch_threads: int = 1, start_timeout_s: float = 300.0,
                 pg_timeout_s: float = 300.0, failure_grace_s: float = 30.0) -> None:
        """torch_threads: per rank. start_timeout_s: for all ranks to start and join.
        pg_timeout_s: torch.distributed's collective timeout. failure_grace_s: see above."""
        super().__init__(world_size, device)
        self.torch_threads = torch_threads
        self.start_timeout_s = start_timeout_s
        self.pg_timeout_s = pg_timeout_s
        self.failure_grace_s = failure_grace_s

    @abc.abstractmethod
    def _stop_ranks(self) -> None:
        """Stop every rank now, by force (they may be stuck in a collective)."""

    def _check_callable(self, started: bool) -> None:
        if self._broken:
            raise WorkerError(f"this worker group is broken ({self._broken}); build a new one")
        if not started:
            raise WorkerError(f"the {self.name} runtime is not started (or was shut down)")

    def _deadline_after(self, value: Any, deadline: float) -> float:
        """The call's deadline once `value` has arrived: a failed reply leaves the others the grace."""
        return min(deadline, time.monotonic() + self.failure_grace_s) if _failed(value) else deadline

    def _out_of_time(self, replies: Mapping[int, Any], stuck: list[int], what: str) -> list[Reply]:
        if any(_failed(v) for v in replies.values()):
            return self._abandon(replies, stuck)
        self._fail(WorkerTimeoutError, f"{what}: ranks {stuck} gave no reply in time; group stopped")

    def _abandon(self, replies: Mapping[int, Reply], stuck: list[int]) -> list[Reply]:
        """A rank failed and the others are stuck (in a collective): stop them all."""
        first = next(r for r in replies.values() if _failed(r))
        self._broken = f"rank {first.rank} failed ({type(first.error).__name__}) while ranks {stuck} were blocked"
        self._stop_ranks()
        blocked = Reply(rank=stuck[0], ok=False, error=WorkerError(self._broken))
        return [replies.get(r, blocked) for r in range(self.world_size)]

    def _fail(self, kind: type[WorkerError], message: str) -> NoReturn:
        self._broken = message
        self._stop_ranks()
        raise kind(message)
