"""Functions and objects the tests run on ranks (`group.run(name, fn, ...)`).

Functions sent to `process`/`ray` ranks are pickled by reference, so they must live in an
importable module like this one (test modules are not importable from another process);
`tests/conftest.py` puts `tests/` on the ranks' `PYTHONPATH`.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch


def full_state(engine: Any, grads: bool = False) -> dict[str, torch.Tensor]:
    """Trainable parameters (or their gradients) as full tensors, keyed by state name.

    Collective under FSDP/TP: every rank must run it; every rank returns the full tensors.
    """
    out = {}
    for name, p in engine.state_tensors().items():
        t = p.grad if grads else p
        if t is None:
            continue
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = t.detach().cpu().clone()
    return out


def full_grads(engine: Any) -> dict[str, torch.Tensor]:
    return full_state(engine, grads=True)


def full_params(engine: Any) -> dict[str, torch.Tensor]:
    return full_state(engine, grads=False)


def sgd_step(engine: Any, lr: float) -> None:
    """p -= lr * grad, then clear: compares layouts without Adam's amplification of noise."""
    with torch.no_grad():
        for p in engine.state_tensors().values():
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)
    engine.clear_gradients()


def pid(_obj: Any) -> int:
    return os.getpid()


def rank_of(ctx: Any) -> int:
    return ctx.rank


def sleep_then(_obj: Any, seconds: float, value: Any = None) -> Any:
    time.sleep(seconds)
    return value


def fail_on_rank(ctx: Any, rank: int, message: str) -> int:
    """Raise ValueError on one rank only (the others return their rank)."""
    if ctx.rank == rank:
        raise ValueError(message)
    return ctx.rank


def block_in_collective_unless_rank(ctx: Any, rank: int) -> int:
    """Every rank but `rank` enters an all-reduce that `rank` never joins (a stuck collective)."""
    import torch.distributed as dist

    if ctx.rank == rank:
        raise ValueError(f"rank {rank} refuses to join the collective")
    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item())


def all_reduce_after_sleep(ctx: Any, sleeper: int, seconds: float) -> float:
    """Rank `sleeper` sleeps, then joins an all-reduce the others entered at once."""
    import torch.distributed as dist

    if ctx.rank == sleeper:
        time.sleep(seconds)
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t.item())


class Counter:
    """A tiny object for group tests: holds a number, reports its rank."""

    def __init__(self, ctx: Any, start: int = 0) -> None:
        self.ctx = ctx
        self.value = start
        self.offloaded = False

    def add(self, k: int) -> int:
        self.value += k
        return self.value

    def echo(self, items: list) -> list:
        return [(self.ctx.rank, x) for x in items]

    def offload(self) -> None:
        self.offloaded = True

    def onload(self) -> None:
        self.offloaded = False


class CounterFactory:
    def __init__(self, start: int = 0) -> None:
        self.start = start

    def __call__(self, ctx: Any) -> Counter:
        return Counter(ctx, self.start)


class FailingFactory:
    """Builds a Counter everywhere except on `rank`, where it raises ValueError."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self, ctx: Any) -> Counter:
        if ctx.rank == self.rank:
            raise ValueError(f"rank {self.rank} cannot build this object")
        return Counter(ctx)


def node_ip(_obj: Any) -> str:
    """The Ray node address this rank runs on (the two-host tests check placement)."""
    import ray

    return ray.util.get_node_ip_address()
