"""Expert parallelism for a mixture-of-experts model (docs/architecture.md#mixture-of-experts).

`ParallelismConfig.ep` ranks, taken from the ranks of `dp_shard` (torchtitan's layout),
split each MoE layer's E experts: rank i of an ep group holds experts
i*E/ep .. (i+1)*E/ep - 1. The ep groups are runs of `ep` consecutive ranks; the ranks
holding the same experts (one per ep group: `world / ep` of them) are the expert's
replicas. The mesh of the expert weights is (`ep_replicate`, `ep`) = (world / ep, ep).

* **Weights.** Each fused expert weight (`gate_up_proj`, `down_proj`, and gpt-oss's
  biases) becomes a DTensor `(Replicate(), Shard(0))`: this rank's E/ep experts, and a
  full tensor wherever ember gathers one (`full_tensor`: checkpoints through DCP, which
  reshards on load, so a checkpoint is layout-free; `named_weights`, HF export, gathered
  weight sync). An expert LoRA's A (E * r, in), expert-major, is split the same way; its
  B (out, r * E) stays replicated on the mesh (peft interleaves the experts in B's
  columns, so B has no expert-contiguous shard). peft's fold `W + s * B @ A` then runs
  as a DTensor op that keeps W's sharding: each rank forms only its experts' update,
  and the backward all-gathers B's gradient over the ep group. FSDP2 leaves all of
  these out (`ignored_params`): they are not sharded over `dp_shard` a second time.
* **Dispatch** (`ep_experts_forward`, installed through transformers' `ExpertsInterface`,
  its documented registry of expert kernels, so the model's code is unchanged): each
  rank routes its own tokens (the router is replicated), sorts the (token, choice) rows
  by expert, and sends each row to the rank holding its expert with one
  `all_to_all_single` (the counts first, so the splits are known: dropless, no
  capacity); the receiver runs each local expert on its rows, and a second
  `all_to_all_single` returns the rows, which the sender weights by the router's
  top-k weights and sums per token. Both all-to-alls are differentiable (their
  backward is the reverse all-to-all), so an expert's gradient sums the rows of every
  rank of its ep group. Every rank enters both all-to-alls on every MoE layer even
  with no rows to send (the engine's padding passes keep the micro-batch counts equal).
  Pad rows are dispatched as world 1 computes them (the experts module does not see
  which rows are padding); they reach no real token, loss or metric.
* **Replicas** (`world / ep > 1`): a replica's local gradient covers its own ep group's
  tokens; `_SumOverReplicas` (identity forward) all-reduces it over the replicas in
  backward, so every replica holds the summed gradient (contract 2: gradients are sums)
  and applies the same update.

Limits: ep needs tp == 1 and cp == 1 (the ep groups are consecutive ranks of the
data-parallel dims); E must divide by ep (`check_ep`, refused at start).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

EP_MESH_DIMS = ("ep_replicate", "ep")
_NAMES = itertools.count()
# the fused expert tensors a transformers experts module may hold (gpt-oss adds the biases)
EXPERT_PARAMS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def check_ep(num_experts: int, ep: int) -> None:
    """ValueError naming both numbers unless `ep` divides the `num_experts` experts of each layer."""
    if num_experts % ep:
        raise ValueError(f"ParallelismConfig.ep={ep} must divide the model's {num_experts} experts per layer "
                         f"(each ep rank holds num_experts / ep whole experts)")


@dataclass(frozen=True)
class ExpertShard:
    """One rank's part of expert parallelism: its ep group and the experts it holds."""

    group: dist.ProcessGroup  # the ep group (ranks exchanging tokens)
    ep: int
    num_experts: int  # E, per layer
    replicas: dist.ProcessGroup | None  # ranks holding the same experts (None: only this one)

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep


class _SumOverReplicas(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the expert's replicas."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


# ---------------------------------------------------------------------- pure layout functions
def dispatch_order(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): the flat (token, choice) rows sorted by expert (stable, so a token's
    rows keep their order within an expert) and the rows per expert (E,)."""
    flat = top_k_index.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)


def received_expert_ids(recv_counts: torch.Tensor, local_experts: int) -> torch.Tensor:
    """Local expert id of each received row: `recv_counts` (ep * local,) is, per source rank,
    its rows per local expert, in the order the rows arrive."""
    ids = torch.arange(local_experts, device=recv_counts.device).repeat(recv_counts.numel() // local_experts)
    return torch.repeat_interleave(ids, recv_counts)


def inverse(perm: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(perm)
    out[perm] = torch.arange(perm.numel(), device=perm.device)
    return out


# ---------------------------------------------------------------------- compute
def local_weights(module: nn.Module, shard: ExpertShard, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """This rank's experts' tensors (LoRA folded in by peft's parametrization when active),
    as plain tensors in the compute dtype."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    out = {}
    for name in EXPERT_PARAMS:
        t = getattr(module, name, None)
        if t is None:
            continue
        if isinstance(t, DTensor):  # make sure of the experts split whatever the fold's propagation chose
            t = t.redistribute(placements=(Replicate(), Shard(0))).to_local()
        if shard.replicas is not None and t.requires_grad:
            t = _SumOverReplicas.apply(t, shard.replicas)
        out[name] = t.to(dtype)
    return out


def run_local_experts(module: nn.Module, w: dict[str, torch.Tensor], rows: torch.Tensor,
                      counts: list[int]) -> torch.Tensor:
    """Each local expert on its consecutive block of `rows` (`counts` per expert), with the
    family's activation (`_apply_gate`, which transformers' experts decorator provides) and
    weight layout (`is_transposed`: (E, in, out)). Empty blocks still run, so the weights are
    in the graph on every rank (the replica all-reduce runs in every rank's backward)."""
    transposed = bool(getattr(module, "is_transposed", False))
    outs = []
    for e, x in enumerate(torch.split(rows, counts)):
        h = x @ w["gate_up_proj"][e] if transposed else F.linear(x, w["gate_up_proj"][e])
        if "gate_up_proj_bias" in w:
            h = h + w["gate_up_proj_bias"][e]
        h = module._apply_gate(h)
        o = h @ w["down_proj"][e] if transposed else F.linear(h, w["down_proj"][e])
        if "down_proj_bias" in w:
            o = o + w["down_proj_bias"][e]
        outs.append(o)
    return torch.cat(outs)


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Rows to the ep ranks (`send` per rank) and theirs back (`recv` per rank): torch's
    differentiable all-to-all (what the deprecated `torch.distributed.nn` one points to)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    out = all_to_all_single_autograd(rows.contiguous(), recv, send, group)
    return out.wait() if hasattr(out, "wait") else out


def ep_experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    """The experts of one MoE layer over the ep group (see the module docstring): hidden
    (T, H), top_k_index / top_k_weights (T, k) -> (T, H)."""
    k = top_k_index.shape[1]
    local = shard.local_experts
    order, counts = dispatch_order(top_k_index, shard.num_experts)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=shard.group)
    send = counts.view(shard.ep, local).sum(1).tolist()
    recv = recv_counts.view(shard.ep, local).sum(1).tolist()
    received = _exchange(hidden_states[order // k], send, recv, shard.group)
    by_expert = torch.argsort(received_expert_ids(recv_counts, local), stable=True)
    w = local_weights(module, shard, hidden_states.dtype)
    out = run_local_experts(module, w, received[by_expert], recv_counts.view(shard.ep, local).sum(0).tolist())
    returned = _exchange(out[inverse(by_expert)], recv, send, shard.group)
    return combine(returned, order, top_k_weights).to(hidden_states.dtype)


def combine(rows: torch.Tensor, order: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """(T, H): each token's expert outputs (`rows`, in `dispatch_order`'s order) weighted by
    the router's top-k weights and summed in choice order, as transformers' experts sum them."""
    tokens, k = top_k_weights.shape
    weighted = rows[inverse(order)] * top_k_weights.reshape(-1, 1).to(rows.dtype)
    return weighted.view(tokens, k, -1).sum(dim=1)


# ---------------------------------------------------------------------- laying a model out
def _shard_param(module: nn.Module, name: str, mesh, placements) -> nn.Parameter:
    from torch.distributed.tensor import distribute_tensor

    p = getattr(module, name)
    # every rank loaded the full tensor: each keeps its part, no communication
    dt = distribute_tensor(p.detach(), mesh, placements, src_data_rank=None)
    new = nn.Parameter(dt, requires_grad=p.requires_grad)
    module.register_parameter(name, new)
    return new


def expert_modules(model: nn.Module, experts_path: str) -> list[tuple[nn.Module, list[nn.Module]]]:
    """(transformers experts module, the peft LoRA wrappers around it, outermost first) per
    MoE layer, found by the family's experts path (`MoeLayout.experts`)."""
    out = []
    for name, m in model.named_modules():
        if not (name == experts_path or name.endswith("." + experts_path)):
            continue
        wrappers = []
        while hasattr(m, "base_layer"):
            wrappers.append(m)
            m = m.base_layer
        out.append((m, wrappers))
    return out


def shard_experts(model: nn.Module, experts_path: str, mesh) -> set[nn.Parameter]:
    """Make every layer's expert weights (and their LoRA factors) DTensors on the
    (ep_replicate, ep) `mesh`; returns the new parameters (for FSDP2 to leave out)."""
    from torch.distributed.tensor import Replicate, Shard

    params: set[nn.Parameter] = set()
    for experts, wrappers in expert_modules(model, experts_path):
        for name in EXPERT_PARAMS:
            if isinstance(getattr(experts, name, None), nn.Parameter):
                params.add(_shard_param(experts, name, mesh, (Replicate(), Shard(0))))
        for wrapper in wrappers:  # A (E * r, in) is expert-major: split like the weights; B stays whole
            for linear in wrapper.lora_A.values():
                params.add(_shard_param(linear, "weight", mesh, (Replicate(), Shard(0))))
            for linear in wrapper.lora_B.values():
                params.add(_shard_param(linear, "weight", mesh, (Replicate(), Replicate())))
    if not params:
        raise ValueError(f"expert parallelism found no experts module {experts_path!r} in the model")
    return params


def install_experts(hf: nn.Module, shard: ExpertShard) -> str:
    """Register `ep_experts_forward` for `shard` in transformers' experts registry and make
    the transformers model `hf` use it. Returns its registered name."""
    from transformers.integrations.moe import ExpertsInterface

    name = f"ember_ep_{next(_NAMES)}"

    def forward(module, hidden_states, top_k_index, top_k_weights):
        return ep_experts_forward(module, hidden_states, top_k_index, top_k_weights, shard)

    ExpertsInterface.register(name, forward)
    hf.set_experts_implementation(name)
    return name
