"""The `TrainingEngine` interface: what the service (and the workers) may ask of an engine.

Semantics are Tinker's (see docs/architecture.md contracts 1, 2, 6, 7):

* `forward_backward` adds ∇ Σ_datums loss(datum) to the gradient accumulator — a plain SUM,
  identical for any micro-batching, packing, parallel layout or split of the batch over
  several calls. No hidden normalisation.
* `optim_step` applies exactly the accumulated gradient (AdamW, optional global-norm
  clipping) and clears it; a non-finite gradient is refused with `NonFiniteGradientError`
  and leaves weights and optimizer state untouched.
* Bad input raises `ValueError` naming the datum index and the field, before any gradient
  is touched.

The distributed layout (FSDP2/TP/DP) lives *behind* this interface and never changes it.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tinker import types

LossConfig = Mapping[str, float | str]


class NonFiniteGradientError(RuntimeError):
    """`optim_step` found a NaN/inf gradient; nothing was applied."""


@dataclass
class EngineStatus:
    step: int  # optimizer steps applied so far
    accumulated_micro_batches: int  # micro-batches whose gradient is waiting for optim_step
    accumulated_datums: int
    accumulated_tokens: int


@dataclass
class EngineInfo:
    model_name: str
    model_type: str  # HF config.model_type, e.g. "qwen3"
    is_lora: bool
    lora_rank: int | None
    lora_config: dict[str, Any] | None
    # `ParallelismConfig.as_dict`: {"world_size": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1}, plus "cp" when > 1
    parallel: dict[str, int]
    device: str
    dtype: str
    num_parameters: int
    num_trainable_parameters: int
    packing: str  # "packed" (block-diagonal attention via position_ids) or "padded"
    head: str = "policy"  # the run's output head (`ember.engine.heads.HEADS`): "policy" | "value"
    extra: dict[str, Any] = field(default_factory=dict)


class TrainingEngine(abc.ABC):
    """One trainable model (full fine-tune or one LoRA adapter) and its optimizer."""

    @abc.abstractmethod
    def forward_backward(
        self, datums: Sequence[types.Datum], loss_fn: str, loss_fn_config: LossConfig | None = None
    ) -> types.ForwardBackwardOutput:
        """Compute the loss, accumulate its gradient; per-datum `logprobs` (the head's output:
        log-probs of the targets, or values for a value head) and `elementwise_loss`."""

    @abc.abstractmethod
    def forward(
        self, datums: Sequence[types.Datum], loss_fn: str, loss_fn_config: LossConfig | None = None
    ) -> types.ForwardBackwardOutput:
        """As `forward_backward`, without touching gradients."""

    @abc.abstractmethod
    def optim_step(self, adam_params: types.AdamParams) -> dict[str, float]:
        """Apply the accumulated gradient with AdamW; return metrics (`name:reduction` keys)."""

    @abc.abstractmethod
    def clear_gradients(self) -> None:
        """Drop the accumulated gradient."""

    @abc.abstractmethod
    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream the trained weights as (HF name, full tensor) for weight sync.

        Full fine-tuning: every parameter, in the base model's HF names. LoRA: the adapter
        weights only, in PEFT's saved-adapter names (`...q_proj.lora_A.weight`).
        Tensors are detached copies (safe to keep while training continues).
        """

    def head_weights(self) -> dict[str, torch.Tensor]:
        """The output head's own tensors in transformers' names (a value head: `score.weight`
        (1, H), `score.bias` (1,)); empty for a policy, whose head is the model's `lm_head`.
        Detached copies, like `named_weights`."""
        return {}

    @abc.abstractmethod
    def save_state(self, path: str | os.PathLike, optimizer: bool = True) -> None:
        """Save weights (+ optimizer state), step and RNG with torch.distributed.checkpoint."""

    @abc.abstractmethod
    def load_state(self, path: str | os.PathLike, optimizer: bool = True) -> None:
        """Load a `save_state` directory; `optimizer=False` starts Adam fresh (step 0)."""

    @abc.abstractmethod
    def export_hf(self, path: str | os.PathLike) -> None:
        """Write safetensors loadable by transformers (full FT) or peft (LoRA adapter)."""

    @abc.abstractmethod
    def info(self) -> EngineInfo: ...

    @abc.abstractmethod
    def status(self) -> EngineStatus: ...

    @abc.abstractmethod
    def offload(self) -> None:
        """Move trainable parameters, gradients and optimizer state to CPU (colocation)."""

    @abc.abstractmethod
    def onload(self) -> None:
        """Bring them back to the compute device; training continues bit-identically."""
