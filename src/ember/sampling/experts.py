"""Expert LoRA in TorchSampler versions (docs/architecture.md#mixture-of-experts).

A mixture-of-experts adapter adapts fused 3-D expert weights, which no Linear forward
hook can reach: the experts run inside one module (`mlp.experts`) on the tokens the
router sent them. A version therefore keeps, per fused weight, its adapter factors
(`ExpertDelta`), and `ExpertHooks` puts a forward hook (a documented PyTorch extension
point) on each adapted experts module: for the batch rows that sample from a version, it
runs the module again on those rows' tokens, with the same routing, through
`torch.func.functional_call` with the adapted weights (`ember.models.experts.
adapted_weight`, the fold peft's trainer uses), and puts the result in those rows of the
module's output. The base module is never modified; rows of different versions (and
base rows) share one forward. A version's memory is its factors only; the adapted
weights exist during that module's call.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch
from tinker import types
from torch import nn

from ember.models.experts import adapted_weight

ExpertPlan = dict[str, list[tuple[torch.Tensor | None, dict[str, "ExpertDelta"]]]]


@dataclass(frozen=True)
class ExpertDelta:
    """The adapter of one fused expert weight: peft's A (E * r, in) and B (out, r * E)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    num_experts: int
    transposed: bool

    def weight(self, base: torch.Tensor) -> torch.Tensor:
        return adapted_weight(base, self.a, self.b, self.num_experts, self.transposed, self.scale)


def expert_module_and_param(weight_name: str) -> tuple[str, str]:
    """`model.layers.0.mlp.experts.down_proj` -> (`model.layers.0.mlp.experts`, `down_proj`)."""
    module, _, param = weight_name.rpartition(".")
    return module, param


class ExpertHooks:
    """Applies expert deltas to chosen batch rows during one forward (see the module
    docstring). `plan` maps an experts module to [(rows, {param: delta})], rows a
    LongTensor of batch rows or None for every row; hooks are registered lazily, on the
    thread that runs the forwards, and do nothing without a plan."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.plan: ExpertPlan = {}
        self.batch_rows = 1
        self._hooked: set[str] = set()
        self._recomputing = False  # the hook's own call of the module must not re-enter it

    def set_plan(self, plan: ExpertPlan, batch_rows: int) -> None:
        for name in plan:
            if name not in self._hooked:
                self.model.get_submodule(name).register_forward_hook(self._make_hook(name))
                self._hooked.add(name)
        self.plan, self.batch_rows = plan, batch_rows

    def clear(self) -> None:
        self.plan = {}

    def _make_hook(self, name: str):
        def hook(module, args, output):
            entries = self.plan.get(name)
            if not entries or self._recomputing:
                return None
            self._recomputing = True
            try:
                return _adapted_output(module, args, output, entries, self.batch_rows)
            finally:
                self._recomputing = False

        return hook


def _adapted_output(module: nn.Module, args: tuple, output: torch.Tensor, entries, batch_rows: int) -> torch.Tensor:
    """`output` with each entry's rows recomputed with its adapted weights (same routing)."""
    per_row = output.shape[0] // batch_rows  # the module sees the (rows x T) tokens flattened
    output = output.clone()
    for rows, deltas in entries:
        params = {p: d.weight(getattr(module, p)) for p, d in deltas.items()}
        if rows is None:
            output = torch.func.functional_call(module, params, args)
            continue
        tokens = (rows[:, None] * per_row + torch.arange(per_row, device=rows.device)).flatten()
        sub = tuple(a[tokens] if torch.is_tensor(a) and a.shape[:1] == output.shape[:1] else a for a in args)
        output[tokens] = torch.func.functional_call(module, params, sub)
    return output


def expert_plan(row_versions) -> ExpertPlan:
    """Hook plan for a forward whose rows sample from the given versions' expert deltas."""
    plan: dict[str, dict[int, tuple[torch.Tensor | None, dict[str, ExpertDelta]]]] = {}
    for i, (rows, version) in enumerate(row_versions):
        for weight_name, delta in (getattr(version, "experts", None) or {}).items():
            module, param = expert_module_and_param(weight_name)
            entry = plan.setdefault(module, {}).setdefault(i, (rows, {}))
            entry[1][param] = delta
    return {module: list(by_version.values()) for module, by_version in plan.items()}


# ---------------------------------------------------------------- routing records
# For routing replay (docs/architecture.md#mixture-of-experts) the sampler keeps, per
# sequence, the experts every MoE layer chose for each token it ran: the prompt's tokens
# (prefill) and each sampled token fed back (decode). The last sampled token is never run,
# so a sequence of n tokens has n - 1 routes, the routes of exactly the positions a
# training datum `prompt + sampled[:-1]` feeds the model.


@dataclass(frozen=True)
class RoutedSequence(types.SampledSequence):
    """A `SampledSequence` with the routes of its tokens, (P, layers, k) for the prompt
    (-1 rows: a prompt prefix whose KV came from the prefix cache, not run) and
    (n - 1, layers, k) for the sampled tokens fed back; int16. The wire and the SDK see a
    `SampledSequence` (the service keeps the routes in its stability records)."""

    prompt_routes_np: np.ndarray | None = field(default=None, repr=False)
    routes_np: np.ndarray | None = field(default=None, repr=False)


def with_routes(seq: types.SampledSequence, prompt_routes: np.ndarray | None,
                routes: list[np.ndarray]) -> RoutedSequence:
    layers_k = prompt_routes.shape[1:] if prompt_routes is not None else (routes[0].shape if routes else (0, 0))
    sampled = np.stack(routes) if routes else np.zeros((0, *layers_k), np.int16)
    return RoutedSequence(stop_reason=seq.stop_reason, sequence_id=seq.sequence_id, tokens_np=seq.tokens_np,
                          logprobs_np=seq.logprobs_np, topk_logprobs_np=seq.topk_logprobs_np,
                          prompt_routes_np=prompt_routes, routes_np=sampled)


class RouteRecorder:
    """The experts each router of a mixture-of-experts model chose during one forward: a
    forward hook on every router (as `ember.engine.moe.RouterCapture` for the trainer)
    reads its third output, the (tokens, k) top-k indices transformers' routers return."""

    def __init__(self, model: nn.Module) -> None:
        from ember.engine.moe import RouterCapture
        from ember.models.families import moe_of

        layout = moe_of(model.config)
        self.routers = RouterCapture(model, layout).routers if layout is not None else []

    @contextlib.contextmanager
    def capture(self, batch_rows: int, out: list):
        """Within the context, each forward's routes are appended to `out` as one
        (rows, T, layers, k) int16 CPU tensor; nothing for a dense model."""
        if not self.routers:
            yield
            return
        layers: list[torch.Tensor] = []
        hooks = [r.register_forward_hook(lambda _m, _a, o: layers.append(o[2])) for r in self.routers]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()
        if len(layers) == len(self.routers):
            flat = torch.stack(layers, dim=1).to("cpu", torch.int16)  # (rows * T, layers, k)
            out.append(flat.view(batch_rows, -1, *flat.shape[1:]))
