"""LoRA on fused expert weights, as pure functions of tensors (docs/architecture.md#mixture-of-experts).

peft 0.21 adapts a 3-D expert weight W (E, d1, d2) through `target_parameters`: one
`lora_A` (E * r, in) and one `lora_B` (out, r * E) per weight, expert e's factors being
rows e*r..e*r+r-1 of A and columns e, E+e, 2E+e, ... of B (peft's `ParamWrapper`
layout). The adapted expert computes with W + scale * delta, where

    delta[e] = B_e @ A_e          (out, in)   for weights stored (E, out, in) (Qwen3-MoE)
    delta[e] = (B_e @ A_e)^T      (in, out)   for weights stored (E, in, out) (gpt-oss)

`expert_delta` is that expression, shared by the merged export (`ember.engine.hf_export`)
and the sampler's expert versions (`ember.sampling.experts`). An adapter names the two
weights of one experts module by nesting: `<layer>.mlp.experts.lora_A` belongs to the
last of `MoeLayout.params`, `<layer>.mlp.experts.base_layer.lora_A` to the one before
(`expert_weight_name`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from ember.models.families import MoeLayout


def num_experts(config: dict, layout: MoeLayout) -> int:
    """E from a config.json dict: the family's name for it, or `num_local_experts`, which
    transformers writes for both families (its attribute map aliases the two)."""
    for key in (layout.num_experts, "num_local_experts", "num_experts"):
        if isinstance(config.get(key), int):
            return int(config[key])
    raise ValueError(f"config.json of a {config.get('model_type')!r} model names no expert count "
                     f"({layout.num_experts!r} or 'num_local_experts')")


def expert_weight_name(module: str, layout: MoeLayout) -> str | None:
    """The fused weight (`model.layers.0.mlp.experts.down_proj`) an adapter module path
    (`model.layers.0.mlp.experts`, `....experts.base_layer`) adapts; None for any other module."""
    depth = 0
    while module.endswith(".base_layer"):
        module, depth = module[: -len(".base_layer")], depth + 1
    if not (module == layout.experts or module.endswith("." + layout.experts)) or depth >= len(layout.params):
        return None
    return f"{module}.{layout.params[len(layout.params) - 1 - depth]}"


def expert_adapter_module(weight_name: str, layout: MoeLayout) -> str:
    """The inverse of `expert_weight_name`: the adapter module path peft gives the fused weight
    `weight_name` (`model.layers.0.mlp.experts.down_proj` -> `model.layers.0.mlp.experts` plus
    one `.base_layer` per parameter adapted after it)."""
    module, _, param = weight_name.rpartition(".")
    depth = len(layout.params) - 1 - layout.params.index(param)
    return module + ".base_layer" * depth


def expert_factors(a: torch.Tensor, b: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """peft's (E * r, in) A and (out, r * E) B as per-expert (E, r, in) and (E, out, r)."""
    if a.shape[0] % num_experts or b.shape[1] != a.shape[0]:
        raise ValueError(f"expert LoRA factors of shapes {tuple(a.shape)} and {tuple(b.shape)} do not hold "
                         f"{num_experts} experts of one rank (A (E * r, in), B (out, r * E))")
    a3 = a.reshape(num_experts, -1, a.shape[-1])
    b3 = b.reshape(b.shape[0], -1, num_experts).permute(2, 0, 1)
    return a3, b3


def expert_delta(a: torch.Tensor, b: torch.Tensor, num_experts: int, transposed: bool,
                 scale: float) -> torch.Tensor:
    """scale * the per-expert update of a fused weight, in its stored shape (see the module docstring)."""
    a3, b3 = expert_factors(a, b, num_experts)
    delta = torch.bmm(b3, a3)  # (E, out, in)
    return (delta.transpose(1, 2) if transposed else delta) * scale


def adapted_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, num_experts: int, transposed: bool,
                   scale: float) -> torch.Tensor:
    """weight + scale * its per-expert update, as peft folds it for a forward (one `baddbmm`
    in the weight's dtype, no (E, out, in) update held apart)."""
    a3, b3 = expert_factors(a.to(weight.dtype), b.to(weight.dtype), num_experts)
    lhs, rhs = (a3.transpose(1, 2), b3.transpose(1, 2)) if transposed else (b3, a3)
    return torch.baddbmm(weight, lhs, rhs, alpha=scale)


def factor_shapes(weight_shape: tuple[int, ...], rank: int, transposed: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (A, B) shapes of a rank-`rank` adapter on a fused (E, d1, d2) expert weight."""
    experts, d1, d2 = weight_shape
    fan_in, fan_out = (d1, d2) if transposed else (d2, d1)
    return (experts * rank, fan_in), (fan_out, rank * experts)


_PER_EXPERT = re.compile(r"(?P<experts>.+)\.(?P<index>\d+)\.(?P<module>[^.]+)\.weight")


def per_expert_slot(name: str, layout: MoeLayout) -> tuple[str, int, int, int] | None:
    """A hub per-expert tensor name (`...mlp.experts.3.up_proj.weight`) as (the fused weight's
    name, expert index, part, parts: its rows of that expert's fused matrix, `part_rows`);
    None for any other name."""
    m = _PER_EXPERT.fullmatch(name)
    if m is None or not (m["experts"] == layout.experts or m["experts"].endswith("." + layout.experts)):
        return None
    for module, fused, part, parts in layout.per_expert:
        if module == m["module"]:
            return f"{m['experts']}.{fused}", int(m["index"]), part, parts
    return None


def part_rows(matrix: torch.Tensor, part: int, parts: int) -> torch.Tensor:
    """Block `part` of `parts` equal row blocks of one expert's (out, in) matrix."""
    size = matrix.shape[0] // parts
    return matrix[part * size:(part + 1) * size]


def fused_expert_weights(named: Iterable[tuple[str, torch.Tensor]], layout: MoeLayout,
                         experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` with a hub checkpoint's per-expert tensors (`per_expert_slot`) fused into the
    model's 3-D weights (expert-major, parts in order: what transformers' loader builds),
    each yielded once all its experts have come by; every other tensor passes through.
    Incomplete experts are a ValueError naming the weight."""
    parts = {f"{layout.experts}.{fused}": sum(1 for _, f, _, _ in layout.per_expert if f == fused)
             for _, fused, _, _ in layout.per_expert}
    pending: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
    for name, t in named:
        slot = per_expert_slot(name, layout)
        if slot is None:
            yield name, t
            continue
        weight, e, part, n = slot
        got = pending.setdefault(weight, {})
        got[(e, part)] = t
        if len(got) == experts * n:
            yield weight, torch.stack([torch.cat([got[(i, p)] for p in range(n)]) for i in range(experts)])
            del pending[weight]
    if pending:
        weight, got = next(iter(pending.items()))
        per = next(n for f, n in parts.items() if weight.endswith("." + f) or weight == f)
        raise ValueError(f"expert weight {weight!r}: {len(got)} per-expert tensors, expected {experts * per} "
                         f"({experts} experts x {per})")
