"""Optimizer policies of a `TorchEngine`: AdamW (the default) and Dimuon.

The engine owns what every optimizer shares (the global gradient norm, the non-finite
refusal, global-norm clipping, the step counter); a policy owns its per-parameter state
and the update. `OPTIMIZERS` (a plain dict, by the optimizer config's `type`) holds one
`OptimizerEntry` per optimizer: its policy, the SDK config type that selects it at run
creation, the params type one `optim_step` takes and the type the server reads a wire
body as. The service's config validation, the server's request parsing and the
in-process client all read this one entry: adding an optimizer is one policy class and
one entry.

Checkpoints (`ember.engine.checkpoint`) see a policy only through `state` (parameter →
{slot: tensor}), `slots` (the slot names) and `init_state` (empty slots to load into), so
Dimuon's state is saved, loaded and resharded by DCP exactly as Adam's moments are.

Dimuon, per trainable tensor W viewed as a matrix (m × n; a vector is 1 × n, a tensor of
more dims is `shape[0] × rest`), for one `optim_step(DimuonParams)`:

    G  ← the accumulated gradient, after global-norm clipping by `grad_clip_norm`
    M  ← β·M + (1 − β)·G                                  momentum (EMA, β = beta1)
    r_i = mean_j M_ij²,  c_j = mean_i M_ij²              row / column mean squares
    R = diag(r / mean(r) + δ)^(-1/2),  C = diag(c / mean(c) + δ)^(-1/2)
    O  = msign(R·M·C) = U·Vᵀ                              (thin SVD R·M·C = U·S·Vᵀ)
    D  = sqrt(k) · O / ‖O‖_F,   k = min(m, n)             direction, ‖D‖_F = sqrt(k)
    W ← W − lr · ρ · D,   ρ = (32 / r_lora)^γ for a LoRA run, 1 for full fine-tuning

What follows Tinker's public description (DimuonParams docs): the direction is the matrix
sign of the momentum with a damped row/column preconditioner; the learning rate is applied
to a direction of Frobenius norm sqrt(rank); the rank correction is relative to rank 32
and applied uniformly to all LoRA matrices (A and B alike, using the run's LoRA rank), and
an exponent of 0 disables it; `grad_clip_norm` ≤ 0 disables clipping; `beta1` is the
momentum's EMA coefficient. For a LoRA matrix k = min(m, n) is the LoRA rank.

What is our choice (the description does not fix it): the preconditioner's form above
(Adafactor-style factored second moment of the momentum, each factor normalised by its
mean so δ is relative); δ = `DAMPING`, γ = `RANK_LR_EXPONENT` (the SDK 0.38 `DimuonParams`
carries neither; a newer SDK's `damping` / `rank_lr_correction_exponent` fields are read
when present); the matrix sign is an exact fp32 SVD polar factor (not a Newton–Schulz
iteration), with singular values below `k·eps·s_max` treated as zero so a rank-deficient
momentum (LoRA A's is zero while B is zero) gives a zero or lower-rank direction rather
than amplified noise; vectors (norms, biases) take the same rule as 1 × n matrices, whose
direction is M/‖M‖ scaled to norm 1; no weight decay (DimuonParams has none); the momentum
is stored in the parameter's dtype, like Adam's moments, and computed in fp32.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pydantic
import torch
from tinker import types

from ember.errors import UserError

DAMPING = 0.1
RANK_LR_EXPONENT = 0.5
REFERENCE_RANK = 32


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _like_param(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`full` laid out like `p`: this rank's shard of a DTensor parameter, else itself."""
    if not hasattr(p, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor

    # Every rank computed the same full tensor: each keeps its own shard, no communication.
    return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)


class Optimizer(abc.ABC):
    """A run's optimizer: validates its params type and applies one update to `params`.
    `name` and `params_type` are set from its `OPTIMIZERS` entry by `build_optimizer`."""

    name: str
    params_type: type
    slots: tuple[str, ...]

    @property
    @abc.abstractmethod
    def state(self) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """Parameter → its state slots (empty before the parameter's first update)."""

    @abc.abstractmethod
    def init_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """Fresh slots for `p` (what a checkpoint is loaded into)."""

    @abc.abstractmethod
    def validate(self, params) -> None:
        """ValueError for out-of-range hyperparameters."""

    @abc.abstractmethod
    def step(self, params) -> None:
        """Apply one update from the parameters' (already clipped) `.grad`."""

    def check_type(self, params) -> None:
        if not isinstance(params, self.params_type):
            raise TypeError(
                f"optim_step got {params_name(params)} but this run's optimizer is {self.name} "
                f"(created with optimizer={{'type': {self.name!r}}}); pass {self.params_type.__name__}"
            )

    def zero_grad(self, params: Sequence[torch.nn.Parameter]) -> None:
        for p in params:
            p.grad = None


def _validate_adam(p: types.AdamParams) -> None:
    checks = [
        ("learning_rate", p.learning_rate >= 0),
        ("beta1", 0 <= p.beta1 < 1),
        ("beta2", 0 <= p.beta2 < 1),
        ("eps", p.eps > 0),
        ("weight_decay", p.weight_decay >= 0),
        ("grad_clip_norm", p.grad_clip_norm >= 0),
    ]
    for name, ok in checks:
        value = getattr(p, name)
        if not ok or not math.isfinite(value):
            raise UserError(f"AdamParams.{name}={value} is out of range")


class AdamW(Optimizer):
    """`torch.optim.AdamW` with the step's `AdamParams` written into its param group."""

    slots = ("step", "exp_avg", "exp_avg_sq")

    def __init__(self, params: Sequence[torch.nn.Parameter], lora_rank: int | None = None) -> None:
        d = types.AdamParams()
        self.torch = torch.optim.AdamW(
            params, lr=d.learning_rate, betas=(d.beta1, d.beta2), eps=d.eps, weight_decay=d.weight_decay
        )

    @property
    def state(self):
        return self.torch.state

    def init_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            "step": torch.tensor(0.0),
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
        }

    def validate(self, params: types.AdamParams) -> None:
        _validate_adam(params)

    def step(self, params: types.AdamParams) -> None:
        for group in self.torch.param_groups:
            group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2),
                         eps=params.eps, weight_decay=params.weight_decay)
        self.torch.step()

    def zero_grad(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.torch.zero_grad(set_to_none=True)


def as_matrix(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, -1) if t.dim() < 2 else t.reshape(t.shape[0], -1)


def matrix_sign(x: torch.Tensor) -> torch.Tensor:
    """U·Vᵀ of the thin SVD of `x` (fp32), dropping singular values below k·eps·s_max."""
    u, s, vh = torch.linalg.svd(x.float(), full_matrices=False)
    keep = s > s.max() * min(x.shape) * torch.finfo(torch.float32).eps if s.numel() else s > 0
    return (u * keep.to(u.dtype)) @ vh


def dimuon_direction(m: torch.Tensor, damping: float) -> torch.Tensor:
    """D for one momentum matrix `m` (m × n, fp32): see the module docstring."""
    sq = m.square()
    rows, cols = sq.mean(dim=1), sq.mean(dim=0)
    if float(rows.max()) == 0.0:
        return torch.zeros_like(m)
    r = (rows / rows.mean() + damping).rsqrt()
    c = (cols / cols.mean() + damping).rsqrt()
    o = matrix_sign(r[:, None] * m * c[None, :])
    norm = torch.linalg.matrix_norm(o)
    if float(norm) == 0.0:
        return torch.zeros_like(m)
    return o * (math.sqrt(min(m.shape)) / norm)


def rank_scale(lora_rank: int | None, exponent: float) -> float:
    """ρ = (32 / r)^γ for a LoRA run of rank r; 1 for full fine-tuning or γ = 0."""
    if lora_rank is None or exponent == 0:
        return 1.0
    return (REFERENCE_RANK / lora_rank) ** exponent


class Dimuon(Optimizer):
    """Matrix-sign (polar) direction of the preconditioned momentum; see the module docstring."""

    slots = ("step", "momentum")

    def __init__(self, params: Sequence[torch.nn.Parameter], lora_rank: int | None = None) -> None:
        self.params = list(params)
        self.lora_rank = lora_rank
        self._state: dict[torch.Tensor, dict[str, torch.Tensor]] = {p: {} for p in self.params}

    @property
    def state(self):
        return self._state

    def init_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"step": torch.tensor(0.0), "momentum": torch.zeros_like(p, memory_format=torch.preserve_format)}

    def validate(self, params: types.DimuonParams) -> None:
        values = {"learning_rate": params.learning_rate, "beta1": params.beta1,
                  "grad_clip_norm": params.grad_clip_norm,
                  "damping": _damping(params), "rank_lr_correction_exponent": _exponent(params)}
        ok = {"learning_rate": values["learning_rate"] >= 0, "beta1": 0 <= values["beta1"] < 1,
              "grad_clip_norm": True, "damping": values["damping"] > 0, "rank_lr_correction_exponent": True}
        for name, value in values.items():
            if not ok[name] or not math.isfinite(value):
                raise UserError(f"DimuonParams.{name}={value} is out of range")

    @torch.no_grad()
    def step(self, params: types.DimuonParams) -> None:
        lr = params.learning_rate * rank_scale(self.lora_rank, _exponent(params))
        for p in self.params:
            if p.grad is None:
                continue
            state = self._state[p]
            if not state:
                state.update(self.init_state(p))
            state["momentum"].mul_(params.beta1).add_(p.grad, alpha=1 - params.beta1)
            state["step"] += 1
            m = as_matrix(_full(state["momentum"]).float())
            d = dimuon_direction(m, _damping(params)).reshape(p.shape)
            p.sub_(_like_param(d.to(p.dtype), p), alpha=lr)


def _damping(params) -> float:
    value = getattr(params, "damping", None)
    return DAMPING if value is None else float(value)


def _exponent(params) -> float:
    value = getattr(params, "rank_lr_correction_exponent", None)
    return RANK_LR_EXPONENT if value is None else float(value)


class DimuonWireParams(types.DimuonParams):
    """SDK 0.38's DimuonParams plus the two fields Tinker's docs list and that SDK lacks:
    taken from a newer SDK's request instead of being dropped (None = ember's default)."""

    damping: float | None = None
    rank_lr_correction_exponent: float | None = None


@dataclass(frozen=True)
class OptimizerEntry:
    """One optimizer, declared once.

    policy: the `Optimizer` class the engine builds for a run.
    config_type: the SDK pydantic type of its `optimizer_config` (chosen by `type`) at
        run creation; it validates the config (unknown fields, versions).
    params_type: what one `optim_step` takes (the SDK's type; like every params type it
        has `grad_clip_norm`, which the engine applies before the policy's step).
    wire_params_type: what the server validates an `optimizer_params` body as (a
        subclass of params_type that keeps newer SDKs' fields); None = params_type.
    """

    policy: type[Optimizer]
    config_type: type[pydantic.BaseModel]
    params_type: type[pydantic.BaseModel]
    wire_params_type: type[pydantic.BaseModel] | None = None

    @property
    def wire_params(self) -> type[pydantic.BaseModel]:
        return self.wire_params_type or self.params_type


OPTIMIZERS: dict[str, OptimizerEntry] = {
    "adamw": OptimizerEntry(AdamW, types.AdamOptimizerConfig, types.AdamParams),
    "dimuon": OptimizerEntry(Dimuon, types.DimuonOptimizerConfig, types.DimuonParams, DimuonWireParams),
}


def params_types() -> tuple[type, ...]:
    """Every optimizer's params type (what `optim_step` accepts at all)."""
    return tuple(entry.params_type for entry in OPTIMIZERS.values())


def params_name(params) -> str:
    """The SDK params type `params` is an instance of (a wire subclass reports its SDK base)."""
    for entry in OPTIMIZERS.values():
        if isinstance(params, entry.params_type):
            return entry.params_type.__name__
    return type(params).__name__


def optimizer_config(cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """A run's optimizer config, validated by its entry's config type, as the plain dict a
    run stores (`{"type": "adamw"}` by default). ValueError naming what is wrong."""
    cfg = dict(cfg or {"type": "adamw"})
    kind = cfg.setdefault("type", "adamw")
    entry = OPTIMIZERS.get(kind)
    if entry is None:
        known = ", ".join(f"{{'type': {k!r}}}" for k in OPTIMIZERS)
        raise UserError(f"optimizer {kind!r} is not supported by ember; use one of {known}")
    try:
        return entry.config_type.model_validate(cfg).model_dump(mode="json")
    except pydantic.ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())
        raise UserError(f"optimizer {kind!r}: {problems}") from None


def build_optimizer(config, params: Sequence[torch.nn.Parameter], lora_rank: int | None) -> Optimizer:
    """The policy named by `config` (an SDK OptimizerConfig, a `{"type": ...}` dict or None = AdamW)."""
    if config is None:
        kind = "adamw"
    elif isinstance(config, dict):
        kind = config.get("type", "adamw")
    else:
        kind = config.type
    if kind not in OPTIMIZERS:
        raise UserError(f"unknown optimizer {kind!r}; known: {', '.join(sorted(OPTIMIZERS))}")
    entry = OPTIMIZERS[kind]
    policy = entry.policy(params, lora_rank)
    policy.name, policy.params_type = kind, entry.params_type
    return policy
