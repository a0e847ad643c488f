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


def vocab_parallel_logprobs(ctx: Any, logits: torch.Tensor, targets: torch.Tensor,
                            grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's vocabulary slice of the full `logits` (T, V) through
    `vocab_parallel_target_logprobs` over the whole group; backward with `grad`.
    Returns (the output, the gradient of this rank's slice)."""
    import torch.distributed as dist

    from ember.engine.vocab_parallel import VocabShard, vocab_parallel_target_logprobs

    shard = VocabShard(dist.group.WORLD, ctx.rank, ctx.world_size, int(logits.shape[1]))
    local = logits[:, shard.offset:shard.offset + shard.rows].clone().requires_grad_(True)
    out = vocab_parallel_target_logprobs(local, targets, shard)
    out.backward(grad)
    return out.detach(), local.grad


def set_params(engine: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Overwrite trainable parameters (by state name) with full tensors; a DTensor takes its
    shard of the full tensor (collective: every rank must run it with the same tensors)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = engine.state_tensors()
    with torch.no_grad():
        for name, full in tensors.items():
            p = params[name]
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements).to_local())
            else:
                p.copy_(full)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def lm_head_local_rows(engine: Any) -> dict[str, int]:
    """Rows of lm_head's weight, and of a LoRA B on lm_head, that this rank holds."""
    held = {"lm_head.weight": engine.model.get_output_embeddings().weight}
    held |= {n: p for n, p in engine.state_tensors().items() if "lm_head.lora_B" in n}
    return {n: int(_local(t).shape[0]) for n, t in held.items()}


def lm_head_is_replicated(engine: Any) -> bool:
    """Whether lm_head's weight is a plain tensor, the input embedding itself (tied)."""
    weight = engine.model.get_output_embeddings().weight
    return not hasattr(weight, "to_local") and weight is engine.model.get_input_embeddings().weight


def lm_head_output_shapes(engine: Any, datums: list, loss_fn: str) -> list[tuple[int, int]]:
    """(rows, columns) of every lm_head output in one forward_backward on this rank (the
    gradient is cleared after)."""
    shapes: list[tuple[int, int]] = []
    module = engine.model.get_output_embeddings()
    handle = module.register_forward_hook(lambda _m, _a, out: shapes.append(tuple(out.flatten(0, -2).shape)))
    try:
        engine.forward_backward(datums, loss_fn)
    finally:
        handle.remove()
    engine.clear_gradients()
    return shapes


def local_shapes(engine: Any) -> dict[str, tuple[int, ...]]:
    """The shape of this rank's part of each trainable tensor (a DTensor's local shard)."""
    return {name: tuple(_local(p).shape) for name, p in engine.state_tensors().items()}


def expert_dispatch_after_sleep(engine: Any, sleeper: int, seconds: float) -> int:
    """Every rank but `sleeper` enters the first MoE layer's expert-parallel dispatch (its
    all-to-all), where it waits for `sleeper`, which sleeps first (kill it meanwhile)."""
    import torch.distributed as dist

    from ember.engine.expert_parallel import expert_modules

    if dist.get_rank() == sleeper:
        time.sleep(seconds)
    experts = expert_modules(engine.model, "mlp.experts")[0][0]
    hidden = torch.randn(3, int(engine.hf_config.hidden_size))
    with torch.no_grad():
        experts(hidden, torch.zeros(3, 1, dtype=torch.int64), torch.ones(3, 1))
    return dist.get_rank()
