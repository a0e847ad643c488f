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
from tinker import types
from torch import nn

from ember.engine.config import check_moe_aux_loss_coef as check_coef
from ember.errors import UserError
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
        self.replay = RouteReplay(routers.routers, layout, config).replay

    def checked_routes(self, routes: list[torch.Tensor | None], lengths: list[int]) -> list[torch.Tensor | None]:
        """Each datum's routes checked against this model (`check_routes`), in request order."""
        return [None if r is None else check_routes(i, r, n, self.layers, self.top_k, self.experts)
                for i, (r, n) in enumerate(zip(routes, lengths))]

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


# ---------------------------------------------------------------- routing replay
# A datum's recorded routes travel in its loss inputs under this key: (N, layers, top_k)
# expert indices per input position, -1 where a position has no record (routed by the
# current router). The service fills it from the sampler's records (docs/architecture.md
# #mixture-of-experts); the engine takes it out before the loss sees the inputs.
ROUTES_KEY = "routed_experts"


def replay_weights(logits: torch.Tensor, indices: torch.Tensor, softmax: str, norm_topk: bool) -> torch.Tensor:
    """The weights the router gives `indices` (T, k) from its `logits` (T, E), computed as
    transformers' router computes them for its own choice (`MoeLayout.router_softmax`), so
    replaying the router's own choice reproduces its output exactly."""
    if softmax == "top_k":  # gpt-oss: softmax over the chosen experts' logits
        chosen = logits.gather(-1, indices)
        return torch.softmax(chosen, dim=-1, dtype=chosen.dtype)
    chosen = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)  # Qwen3-MoE
    if norm_topk:
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    return chosen.to(logits.dtype)


class RouteReplay:
    """Routes tokens through given experts: a forward hook on each router (a documented
    PyTorch extension point: a hook's return value replaces the module's output) swaps the
    router's (logits, weights, indices) for (logits, `replay_weights` of the given
    indices, the given indices) on the tokens that have a route (>= 0), and leaves the
    others as the router chose. The logits are untouched, so the weights keep their
    gradient to the router and the routing metrics and auxiliary loss still read the
    router's own distribution."""

    def __init__(self, routers: list[nn.Module], layout: MoeLayout, config) -> None:
        self.routers = routers
        self.softmax = layout.router_softmax
        self.norm_topk = bool(getattr(config, "norm_topk_prob", False))

    @contextlib.contextmanager
    def replay(self, routes: torch.Tensor | None):
        """Within the context (forward and backward: activation checkpointing re-runs the
        routers in backward), layer l routes flat token t to `routes[l, t]` (layers, T_flat, k)
        where `routes[l, t, 0] >= 0`. None: nothing is replayed."""
        if routes is None:
            yield
            return
        hooks = [r.register_forward_hook(self._hook(routes[layer])) for layer, r in enumerate(self.routers)]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()

    def _hook(self, layer_routes: torch.Tensor):
        def hook(_module, _args, out):
            logits, weights, indices = out
            given = layer_routes.to(indices.device)
            has = (given[:, :1] >= 0)
            chosen = torch.where(has, given, indices)
            replayed = replay_weights(logits, chosen, self.softmax, self.norm_topk)
            return logits, torch.where(has, replayed, weights), chosen

        return hook


def split_routes(datums) -> tuple[list, list[torch.Tensor | None]]:
    """(the datums without their `ROUTES_KEY` input, each one's routes or None)."""
    plain, routes = [], []
    for d in datums:
        td = d.loss_fn_inputs.get(ROUTES_KEY)
        routes.append(None if td is None else td.to_torch())
        if td is None:
            plain.append(d)
            continue
        rest = {k: v for k, v in d.loss_fn_inputs.items() if k != ROUTES_KEY}
        plain.append(types.Datum(model_input=d.model_input, loss_fn_inputs=rest))
    return plain, routes


def check_routes(index: int, routes: torch.Tensor, tokens: int, layers: int, top_k: int, experts: int) -> torch.Tensor:
    """`routes` as int64 (tokens, layers, top_k) with values in [-1, experts); UserError
    naming the datum and the field otherwise."""
    where = f"datum {index}: loss_fn_inputs[{ROUTES_KEY!r}]"
    want = (tokens, layers, top_k)
    if tuple(routes.shape) != want:
        raise UserError(f"{where} has shape {tuple(routes.shape)}; this model needs (input positions, MoE layers, "
                        f"experts per token) = {want}")
    if routes.dtype.is_floating_point or routes.dtype == torch.bool:
        raise UserError(f"{where} must hold integer expert indices, got dtype {routes.dtype}")
    routes = routes.to(torch.int64)
    bad = (routes < -1) | (routes >= experts) | ((routes[..., :1] < 0) != (routes < 0)).any(-1, keepdim=True)
    if bad.any():
        pos = int(bad.nonzero()[0, 0])
        raise UserError(f"{where}: position {pos} holds {routes[pos].tolist()}; each entry is an expert index in "
                        f"[0, {experts}) or, for a position routed by the current router, all -1")
    return routes


def flat_routes(routes: list[torch.Tensor | None], lengths: list[int], valid_index: torch.Tensor, flat_size: int,
                layers: int, top_k: int) -> torch.Tensor | None:
    """A micro-batch's routes in its flat token layout (layers, flat_size, k): each datum's
    routes at its real tokens (`valid_index`), -1 (the router's own choice) at padding and
    for datums without routes. None when no datum of it has routes."""
    if all(r is None for r in routes):
        return None
    per_token = torch.cat([r if r is not None else torch.full((n, layers, top_k), -1, dtype=torch.int64)
                           for r, n in zip(routes, lengths)])
    out = torch.full((flat_size, layers, top_k), -1, dtype=torch.int64)
    out[valid_index.cpu()] = per_token
    return out.transpose(0, 1).contiguous()
