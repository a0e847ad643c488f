"""Weight versions of a TorchSampler: full fine-tuning sets and LoRA adapters.

One base `nn.Module` serves every version:

* a full fine-tuning version is a complete set of parameter tensors, swapped in for one
  forward with `torch.func.functional_call` (the module itself is never modified);
* a LoRA version is only its adapter matrices; `LoraHooks` adds
  `scale * B(A(x))` to the output of each adapted Linear through a forward hook (a
  documented PyTorch extension point), for the batch rows that sample from that
  version. Rows of different adapters (and base rows) share one forward. A
  mixture-of-experts adapter's factors on fused expert weights are applied by
  `ember.sampling.experts.ExpertHooks` on the experts modules.

Versions are immutable: tensors are copied in at `load_weights` and never written to.
The sampler keeps no strong reference to a version, so dropping the last handle frees
its memory.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tinker import types
from torch import nn

from ember.errors import UserError
from ember.models import LORA_ALPHA
from ember.models.experts import expert_adapter_module, expert_weight_name, factor_shapes, fused_expert_weights
from ember.models.families import moe_of
from ember.sampling.base import WeightVersion
from ember.sampling.experts import ExpertDelta

_LORA_NAME = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight")


@dataclass(frozen=True)
class LoraDelta:
    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scale: float


class TorchWeightVersion(WeightVersion):
    """Full fine-tuning parameters (`params`) or LoRA deltas per module name (`lora`)."""

    def __init__(
        self,
        sampler_id: int,
        params: dict[str, torch.Tensor] | None = None,
        lora: dict[str, LoraDelta] | None = None,
        lora_rank: int | None = None,
        experts: dict[str, ExpertDelta] | None = None,
    ) -> None:
        super().__init__(sampler_id, is_lora=lora is not None, lora_rank=lora_rank)
        self.params = params
        self.lora = lora
        self.experts = experts  # fused expert weight name -> its adapter (a MoE LoRA version)

    def nbytes(self) -> int:
        tensors = list(self.params.values()) if self.params else []
        for d in [*(self.lora or {}).values(), *(self.experts or {}).values()]:
            tensors += [d.a, d.b]
        return sum(t.numel() * t.element_size() for t in tensors)


def _place(t: torch.Tensor, device: torch.device, dtype: torch.dtype, copy: bool) -> torch.Tensor:
    t = t.detach()
    if not t.is_floating_point():
        return t.to(device=device, copy=copy)
    return t.to(device=device, dtype=dtype, copy=copy)


def parameter_aliases(model: nn.Module) -> tuple[dict[str, str], dict[str, torch.Size], frozenset[str]]:
    """Map every state_dict name (tied aliases included) to a canonical name; canonical
    shapes; and the canonical names a full version must provide (every parameter)."""
    canonical: dict[int, str] = {}
    alias: dict[str, str] = {}
    shapes: dict[str, torch.Size] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first = canonical.setdefault(id(p), name)
        alias[name] = first
        shapes[first] = p.shape
    required = frozenset(shapes)
    persistent = set(model.state_dict())
    for name, b in model.named_buffers():
        if name in persistent:
            alias[name] = name
            shapes[name] = b.shape
    return alias, shapes, required


def _fused(named_weights: Iterable[tuple[str, torch.Tensor]], config) -> Iterable[tuple[str, torch.Tensor]]:
    """A mixture-of-experts checkpoint's per-expert tensors (a full export in the hub's
    layout) as the model's fused expert weights (`ember.models.experts`)."""
    layout = moe_of(config) if config is not None else None
    if layout is None or not layout.per_expert:
        return named_weights
    return fused_expert_weights(named_weights, layout, int(getattr(config, layout.num_experts)))


def build_full_version(
    sampler_id: int,
    named_weights: Iterable[tuple[str, torch.Tensor]],
    names: tuple[dict[str, str], dict[str, torch.Size], frozenset[str]],
    device: torch.device,
    dtype: torch.dtype,
    copy: bool,
    model_config=None,
) -> TorchWeightVersion:
    """A full fine-tuning version from `named_weights` (every parameter); `model_config`
    (the base model's) lets a mixture-of-experts export in per-expert layout load."""
    aliases, shapes, required = names
    params: dict[str, torch.Tensor] = {}
    for name, t in _fused(named_weights, model_config):
        key = aliases.get(name)
        if key is None:
            hint = " (this looks like a LoRA adapter weight: pass lora_config)" if ".lora_" in name else ""
            raise UserError(f"load_weights: unknown weight name {name!r} for this base model{hint}")
        if tuple(t.shape) != tuple(shapes[key]):
            raise UserError(f"load_weights: {name!r}: expected shape {tuple(shapes[key])}, got {tuple(t.shape)}")
        if key not in params:  # tied aliases carry the same values; keep one tensor
            params[key] = _place(t, device, dtype, copy)
    missing = sorted(required - params.keys())
    if missing:
        raise UserError(
            f"load_weights: a full fine-tuning version needs every parameter of the base model; "
            f"missing {len(missing)} (first: {missing[0]!r})"
        )
    return TorchWeightVersion(sampler_id, params=params)


def version_tensors(version: TorchWeightVersion, layout=None) -> dict[str, torch.Tensor]:
    """`version`'s tensors as `build_full_version` / `build_lora_version` take them back
    (`Sampler.version_weights`): a full version's parameters in the model's canonical names,
    a LoRA version's factors in peft's saved-adapter names, expert factors under the module
    path peft gives them (`layout`: the model's MoeLayout; `expert_adapter_module`)."""
    if version.params is not None:
        return dict(version.params)
    modules = [(m, d.a, d.b) for m, d in (version.lora or {}).items()]
    modules += [(expert_adapter_module(w, layout), d.a, d.b) for w, d in (version.experts or {}).items()]
    out: dict[str, torch.Tensor] = {}
    for module_name, a, b in modules:
        out[f"base_model.model.{module_name}.lora_A.weight"] = a
        out[f"base_model.model.{module_name}.lora_B.weight"] = b
    return out


def _lora_pairs(named_weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in named_weights:
        m = _LORA_NAME.fullmatch(name)
        if m is None:
            raise UserError(
                f"load_weights: {name!r} is not a LoRA adapter weight "
                "(expected PEFT saved-adapter names like 'base_model.model.<module>.lora_A.weight')"
            )
        pairs.setdefault(m["module"], {})[m["ab"]] = t
    return pairs


def build_lora_version(
    sampler_id: int,
    model: nn.Module,
    named_weights: Iterable[tuple[str, torch.Tensor]],
    lora_config: types.LoraConfig,
    device: torch.device,
    dtype: torch.dtype,
    copy: bool,
) -> TorchWeightVersion:
    rank = lora_config.rank
    if rank < 1:
        raise UserError(f"load_weights: LoraConfig.rank must be >= 1, got {rank}")
    deltas: dict[str, LoraDelta] = {}
    experts: dict[str, ExpertDelta] = {}
    layout = moe_of(model.config)
    for module_name, ab in _lora_pairs(named_weights).items():
        if set(ab) != {"A", "B"}:
            raise UserError(f"load_weights: adapter of {module_name!r} has lora_{''.join(ab)} but not both A and B")
        a, b = _place(ab["A"], device, dtype, copy), _place(ab["B"], device, dtype, copy)
        weight_name = expert_weight_name(module_name, layout) if layout is not None else None
        if weight_name is not None:
            experts[weight_name] = _expert_delta(model, weight_name, a, b, rank, layout)
        else:
            deltas[module_name] = _linear_delta(model, module_name, a, b, rank)
    if not deltas and not experts:
        raise UserError("load_weights: a LoRA version needs at least one adapter weight, got none")
    return TorchWeightVersion(sampler_id, lora=deltas, lora_rank=rank, experts=experts or None)


def _check_factors(where: str, a: torch.Tensor, b: torch.Tensor, want_a: tuple, want_b: tuple, rank: int) -> None:
    if tuple(a.shape) != tuple(want_a) or tuple(b.shape) != tuple(want_b):
        raise UserError(
            f"load_weights: adapter of {where!r}: expected lora_A {tuple(want_a)} and lora_B {tuple(want_b)} "
            f"(rank {rank}), got {tuple(a.shape)} and {tuple(b.shape)}"
        )


def _linear_delta(model: nn.Module, module_name: str, a: torch.Tensor, b: torch.Tensor, rank: int) -> LoraDelta:
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        raise UserError(f"load_weights: the base model has no module {module_name!r}") from None
    if not isinstance(module, nn.Linear):
        raise UserError(f"load_weights: {module_name!r} is a {type(module).__name__}, LoRA needs an nn.Linear")
    _check_factors(module_name, a, b, (rank, module.in_features), (module.out_features, rank), rank)
    return LoraDelta(a, b, LORA_ALPHA / rank)


def _expert_delta(model: nn.Module, weight_name: str, a: torch.Tensor, b: torch.Tensor, rank: int,
                  layout) -> ExpertDelta:
    try:
        weight = model.get_parameter(weight_name)
    except AttributeError:
        raise UserError(f"load_weights: the base model has no expert weight {weight_name!r}") from None
    want_a, want_b = factor_shapes(tuple(weight.shape), rank, layout.transposed)
    _check_factors(weight_name, a, b, want_a, want_b, rank)
    return ExpertDelta(a, b, LORA_ALPHA / rank, int(weight.shape[0]), layout.transposed)


class LoraHooks:
    """Adds LoRA deltas to Linear outputs for chosen batch rows during one forward.

    `plan` maps a module name to [(rows, delta)], rows being a LongTensor of batch rows
    or None for every row. Hooks are registered lazily, on the thread that runs the
    forwards, and stay (they do nothing without a plan). A Linear called on the batch's
    tokens flattened to 2-D (Qwen3.5-MoE's shared expert sees (rows x T, hidden)) has its
    rows' tokens adapted: `batch_rows` says how many rows the flat tokens hold.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.plan: dict[str, list[tuple[torch.Tensor | None, LoraDelta]]] = {}
        self.batch_rows = 1
        self._hooked: set[str] = set()

    def set_plan(self, plan: dict[str, list[tuple[torch.Tensor | None, LoraDelta]]], batch_rows: int = 1) -> None:
        for name in plan:
            if name not in self._hooked:
                module = self.model.get_submodule(name)
                module.register_forward_hook(self._make_hook(name))
                self._hooked.add(name)
        self.plan, self.batch_rows = plan, batch_rows

    def clear(self) -> None:
        self.plan = {}

    def _make_hook(self, name: str):
        def hook(module, args, output):
            entries = self.plan.get(name)
            if not entries:
                return None
            if args[0].dim() == 2:  # flat tokens: each row's tokens are adapted
                entries = [(flat_rows(rows, args[0].shape[0] // self.batch_rows), d) for rows, d in entries]
            return add_lora(output, args[0], entries)

        return hook


def flat_rows(rows: torch.Tensor | None, per_row: int) -> torch.Tensor | None:
    """Batch rows as indices of their tokens in the (rows x per_row) flattened batch."""
    if rows is None:
        return None
    return (rows[:, None] * per_row + torch.arange(per_row, device=rows.device)).flatten()


def add_lora(output: torch.Tensor, x: torch.Tensor, entries: list[tuple[torch.Tensor | None, LoraDelta]]):
    """`output` of a Linear on `x` plus each delta, on its rows (None = every row)."""
    for rows, d in entries:
        if rows is None:
            # Same expression as peft's Linear: result + lora_B(lora_A(x)) * scaling.
            output = output + F.linear(F.linear(x, d.a), d.b) * d.scale
        else:
            output = output.index_add(0, rows, F.linear(F.linear(x[rows], d.a), d.b) * d.scale)
    return output


def lora_plan(row_versions: list[tuple[torch.Tensor | None, TorchWeightVersion]]) -> dict:
    """Hook plan for a forward whose rows sample from the given LoRA versions."""
    plan: dict[str, list[tuple[torch.Tensor | None, LoraDelta]]] = {}
    for rows, version in row_versions:
        for module_name, delta in (version.lora or {}).items():
            plan.setdefault(module_name, []).append((rows, delta))
    return plan
