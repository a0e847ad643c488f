"""The runtime seam: how N ranks are started, reached and stopped.

A runtime owns processes (or none: `inline`), not objects. It delivers one `Request` to
every rank at once and returns one `Reply` per rank, or raises:

* `WorkerDiedError` — a rank's process exited (crash, OOM killer, `kill -9`). Detected
  from the process itself (a sentinel for local processes, the actor's death for Ray),
  not from a missed reply, so it surfaces at once even while the other ranks are blocked
  in a collective.
* `WorkerTimeoutError` — no reply within the call's timeout (a hung rank).

After either, the group is *broken*: the surviving ranks may be stuck inside a collective,
so they are killed and the caller rebuilds the group and resumes from its last checkpoint.

Messages are pickled with the standard pickler (tensors by value; never by shared file
descriptors, which would tie a reply's lifetime to the sender process). Factories and
functions sent to ranks must therefore be importable (module-level), not lambdas.
"""

from __future__ import annotations

import abc
import os
import socket
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any


class WorkerError(RuntimeError):
    """A worker group can no longer serve calls."""


class WorkerDiedError(WorkerError):
    """A rank's process died; rebuild the group and resume from the last checkpoint."""


class WorkerTimeoutError(WorkerError):
    """A call did not finish within its timeout; the group has been stopped."""


@dataclass(frozen=True)
class RankContext:
    """Where a rank runs; handed to the factory that builds the rank's object."""

    rank: int
    world_size: int
    local_rank: int
    device_type: str  # "cpu" | "cuda"
    backend: str | None  # `process_group_backend`; None when no process group exists (inline)

    @property
    def device(self) -> str:
        return "cpu" if self.device_type == "cpu" else f"cuda:{self.local_rank}"


@dataclass
class Request:
    """One operation for one rank. `op` is build | call | run | remove | ping | memory."""

    op: str
    target: str | None = None  # object name
    method: str | None = None  # for op == "call"
    fn: Any = None  # factory (build) or function (run)
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass
class Reply:
    rank: int
    ok: bool
    value: Any = None
    error: BaseException | None = None
    traceback: str = ""

    @classmethod
    def failure(cls, rank: int, exc: BaseException) -> "Reply":
        tb = "".join(traceback.format_exception(exc))
        try:  # the exception must survive pickling to reach the caller with its type
            import pickle

            pickle.loads(pickle.dumps(exc))
        except Exception:
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        return cls(rank=rank, ok=False, error=exc, traceback=tb)


def raise_failure(reply: Reply) -> None:
    """Re-raise a rank's exception in the caller, with the rank's traceback attached."""
    exc = reply.error or RuntimeError("unknown worker failure")
    exc.add_note(f"(raised on rank {reply.rank}; remote traceback follows)\n{reply.traceback}")
    raise exc


class Runtime(abc.ABC):
    """Starts `world_size` ranks and runs one request per rank, all ranks at once."""

    name: str = "runtime"

    def __init__(self, world_size: int, device: str = "cpu") -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if device == "cuda" and not cuda_available():
            raise ValueError("device='cuda' requested but this machine has no CUDA device")
        self.world_size = world_size
        self.device_type = device
        self._broken: str | None = None

    @property
    def broken(self) -> str | None:
        """Why this runtime can serve no more calls (None while healthy)."""
        return self._broken

    @property
    def backend(self) -> str:
        return process_group_backend(self.device_type)

    @abc.abstractmethod
    def start(self) -> None:
        """Start the ranks and join them in one process group; raise if that fails."""

    @abc.abstractmethod
    def execute(self, requests: list[Request], timeout_s: float) -> list[Reply]:
        """Deliver `requests[r]` to rank r, return every rank's reply (in rank order)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop every rank (politely, then by force); idempotent."""

    @abc.abstractmethod
    def alive(self) -> list[bool]:
        """Whether each rank's process is still running."""


def process_group_backend(device_type: str) -> str:
    """The default process group's backend: on CUDA NCCL for GPU tensors *and* gloo for CPU
    ones (torchtitan's "cuda:nccl,cpu:gloo"), because some collectives carry CPU tensors:
    FSDP2 `cpu_offload`'s gradients (the grad norm's all-reduce), the metrics' reductions
    (`ember.metrics.distributed`), and `all_gather_object`. NCCL alone refuses them."""
    return "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"


def check_device_count(world_size: int, device_count: int) -> None:
    """A process group of `world_size` ranks on one machine puts rank r on cuda:r: refuse
    (ValueError naming both) a world larger than the GPUs, where ranks would share a GPU,
    which NCCL refuses, or name one that does not exist."""
    if world_size > device_count:
        raise ValueError(f"world_size={world_size} ranks on CUDA need a GPU each, and this machine has "
                         f"{device_count}; use at most {device_count} ranks, or Ray across machines")


def cuda_available() -> bool:
    import torch  # here: `ember.workers` loads without torch (`ember serve` checks its settings first)

    return torch.cuda.is_available()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_rank_process(ctx: RankContext, master_addr: str, port: int, threads: int, pg_timeout_s: float) -> None:
    """Per-rank setup: torch threads, CUDA device, and the default process group."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, threads))
    if ctx.device_type == "cuda":
        torch.cuda.set_device(ctx.local_rank)
    dist.init_process_group(
        backend=ctx.backend,
        init_method=f"tcp://{master_addr}:{port}",
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout=timedelta(seconds=pg_timeout_s),
    )
    os.environ.setdefault("EMBER_RANK", str(ctx.rank))
