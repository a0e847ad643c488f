"""Routing metrics and the load-balancing loss of a mixture-of-experts model
(docs/architecture.md#mixture-of-experts).

`RouterCapture` holds, for one forward, each MoE layer's router logits (T_flat, E): a
forward hook on every router module (a documented PyTorch extension point) for the
duration of the forward only. Everything after is a pure function of those logits and
the micro-batch's layout: only the real tokens (`MicroBatch.valid_index`) are read, so
padding is never counted; routing is dropless (every token goes to its top-k experts,
no capacity), which transformers' expert modules already do.

* `RoutingStats`: expert counts per layer and the router entropy summed over real tokens,
  accumulated over a call's micro-batches (sums: independent of the micro-batching) and,
  under data parallelism, over the ranks (`sum_over_ranks`), then
  `metrics()`: `moe_load_imbalance:max` (the largest, over layers, of the busiest
  expert's assignments over the mean per expert: 1 is balanced, E / k is k experts taking
  every token) and `moe_router_entropy:mean` (nats, of the softmax over all E, per real
  token and layer), and `moe_aux_loss:sum` when the auxiliary loss is on. One colon each:
  the SDK splits every key once into name and reduction (`ember.metrics.keys`), so the keys
  are the same in process and over HTTP.
* `sequence_balance_loss`: the auxiliary load-balancing loss, per sequence and layer
  (DeepSeek-V3's sequence-wise form of Switch's loss): sum_e f_e * P_e with
  f_e = E / (k T) * (tokens of the sequence routed to e) and P_e the mean router
  probability of e over the sequence, summed over sequences and layers. Per sequence, so
  the sum (and its gradient) is the same for any micro-batching, packing, split over
  calls or data-parallel degree, as every loss of ember's (contract 2). 1 per sequence and
  layer is balanced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ember.engine.config import check_moe_aux_loss_coef as check_coef
from ember.models.families import MoeLayout, moe_of


class RouterCapture:
    """The router modules of a model (in layer order) and a context that records their logits."""

    def __init__(self, model: nn.Module, layout: MoeLayout) -> None:
        suffix = "." + layout.router
        self.routers = [m for name, m in model.named_modules() if name.endswith(suffix)]
        if not self.routers:
            raise ValueError(f"no router module {layout.router!r} found in the model")

    @contextlib.contextmanager
    def capture(self):
        logits: list[torch.Tensor] = []
        hooks = [r.register_forward_hook(lambda _m, _a, out: logits.append(out[0])) for r in self.routers]
        try:
            yield logits
        finally:
            for h in hooks:
                h.remove()


def real_token_logits(logits: list[torch.Tensor], valid_index: torch.Tensor) -> torch.Tensor:
    """(layers, T, E) fp32 router logits of the real tokens (valid_index: their flat positions)."""
    index = valid_index.to(logits[0].device)
    return torch.stack([layer.reshape(-1, layer.shape[-1])[index] for layer in logits]).float()


@dataclass
class RoutingStats:
    """A call's routing, summed over its micro-batches (see the module docstring)."""

    top_k: int
    counts: torch.Tensor  # (layers, E) float64 assignments of real tokens
    entropy_sum: float = 0.0
    entries: int = 0  # real tokens x layers
    aux_loss: float | None = None  # the auxiliary loss's value when it is on

    def add(self, logits: torch.Tensor) -> None:
        """Record one micro-batch's (layers, T, E) real-token logits."""
        with torch.no_grad():
            chosen = logits.topk(self.top_k, dim=-1).indices.flatten(1).to(self.counts.device)
            self.counts.scatter_add_(1, chosen, torch.ones_like(chosen, dtype=torch.float64))
            logp = torch.log_softmax(logits, dim=-1)
            self.entropy_sum += float(-(logp.exp() * logp).sum())
            self.entries += logits.shape[0] * logits.shape[1]

    def sum_over_ranks(self, sum_: Callable[[list[torch.Tensor]], None]) -> None:
        """Make the counts and the entropy those of the whole batch, all data-parallel ranks
        together (`sum_`: `ParallelContext.sum_over_dp_`, which every rank calls), so each
        rank reports the world-1 metrics. The auxiliary loss stays this rank's: it is a
        `:sum`, which the ranks' results add up."""
        extra = torch.tensor([self.entropy_sum, float(self.entries)], dtype=torch.float64, device=self.counts.device)
        sum_([self.counts, extra])
        self.entropy_sum, self.entries = float(extra[0]), int(extra[1])

    def metrics(self) -> dict[str, float]:
        if self.entries == 0:
            return {}
        mean = self.counts.mean(dim=1).clamp_min(1e-12)
        out = {"moe_load_imbalance:max": float((self.counts.max(dim=1).values / mean).max()),
               "moe_router_entropy:mean": self.entropy_sum / self.entries}
        if self.aux_loss is not None:
            out["moe_aux_loss:sum"] = self.aux_loss
        return out


def sequence_balance_loss(logits: torch.Tensor, segment_ids: torch.Tensor, top_k: int) -> torch.Tensor:
    """sum over sequences and layers of E/(kT) * sum_e count_e * mean_t p_te (see the module
    docstring); `logits` (layers, T, E) of the real tokens, `segment_ids` (T,) their sequence."""
    layers, _, experts = logits.shape
    seg = segment_ids.to(logits.device)
    n_seq = int(seg.max()) + 1
    probs = torch.softmax(logits, dim=-1)  # (L, T, E)
    chosen = torch.zeros_like(probs).scatter_(-1, logits.topk(top_k, dim=-1).indices, 1.0)
    index = seg[None, :, None].expand(layers, -1, experts)
    prob_sum = torch.zeros(layers, n_seq, experts, dtype=probs.dtype, device=probs.device).scatter_add(1, index, probs)
    count = torch.zeros_like(prob_sum).scatter_add(1, index, chosen)
    tokens = torch.bincount(seg, minlength=n_seq).to(probs.dtype)[None, :, None]
    return (experts / top_k * count / tokens * prob_sum / tokens).sum()


class MoeRouting:
    """What the engine does for a mixture-of-experts model around each micro-batch's
    forward: capture the router logits, record the real tokens' routing, and return the
    auxiliary loss to add to the micro-batch's loss (None when `coef` is 0)."""

    def __init__(self, model: nn.Module, config, coef: float) -> None:
        check_coef(coef)
        layout = moe_of(config)
        routers = RouterCapture(model, layout)
        self.capture = routers.capture
        self.layers, self.experts = len(routers.routers), int(getattr(config, layout.num_experts))
        self.top_k = int(getattr(config, layout.top_k))
        self.coef = float(coef)

    def new_call(self, device: torch.device) -> RoutingStats:
        counts = torch.zeros(self.layers, self.experts, dtype=torch.float64, device=device)
        return RoutingStats(self.top_k, counts, aux_loss=0.0 if self.coef else None)

    def micro_batch(self, stats: RoutingStats, logits: list[torch.Tensor], valid_index: torch.Tensor,
                    segment_ids: torch.Tensor) -> torch.Tensor | None:
        real = real_token_logits(logits, valid_index)
        stats.add(real)
        if not self.coef:
            return None
        aux = self.coef * sequence_balance_loss(real, segment_ids, self.top_k)
        stats.aux_loss += float(aux.detach())
        return aux


def moe_routing(model: nn.Module, config, coef: float) -> MoeRouting | None:
    """The engine's `MoeRouting` for a mixture-of-experts model; None for a dense one."""
    if moe_of(config) is None:
        check_coef(coef)
        return None
    return MoeRouting(model, config, coef)
