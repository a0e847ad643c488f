"""`EngineConfig`: everything a TorchEngine needs to know besides its model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.models.loading import resolve_dtype


@dataclass
class EngineConfig:
    """Configuration of one training engine.

    micro_batch_tokens: token budget of one packed micro-batch (forward + backward at once).
        A datum longer than the budget forms a micro-batch of its own.
    dtype: dtype the parameters (and Adam state) are stored in. Keep "float32" for exact
        training; "bfloat16" halves memory at the cost of bf16 optimizer updates.
    autocast_dtype: None (compute in `dtype`) or "bfloat16"/"float16": run the forward and
        backward under `torch.autocast` with fp32 master weights — the usual single-GPU
        mixed-precision recipe. Under FSDP2, ParallelismConfig's MixedPrecisionPolicy does
        this instead. Log-softmax and losses are always computed in fp32.
    device: "cpu", "cuda" or "cuda:N".
    packing: True packs sequences into one row with block-diagonal attention (via
        position_ids); False pads each micro-batch to its longest sequence.
    attn_implementation: transformers attention backend ("sdpa", "eager", "flash_attention_2").
    seed: seeds dropout-free training RNG (kept in checkpoints for exact resume).
    backend: the engine implementation, by name from `ember.engine.registry.ENGINE_BACKENDS`
        ("torch": TorchEngine).
    """

    micro_batch_tokens: int = 8192
    dtype: str = "float32"
    autocast_dtype: str | None = None
    device: str = "cpu"
    packing: bool = True
    attn_implementation: str = "sdpa"
    seed: int = 0
    backend: str = "torch"

    def __post_init__(self) -> None:
        from ember.engine.registry import ENGINE_BACKENDS

        if self.backend not in ENGINE_BACKENDS:
            raise ValueError(f"EngineConfig.backend {self.backend!r} is unknown; known: {', '.join(ENGINE_BACKENDS)}")
        if self.micro_batch_tokens < 1:
            raise ValueError(f"EngineConfig.micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        resolve_dtype(self.dtype)
        if self.autocast_dtype is not None and resolve_dtype(self.autocast_dtype) not in (torch.bfloat16, torch.float16):
            raise ValueError(f"EngineConfig.autocast_dtype must be None, 'bfloat16' or 'float16', got {self.autocast_dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"EngineConfig.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.attn_implementation not in ("sdpa", "eager", "flash_attention_2", "flex_attention"):
            raise ValueError(f"EngineConfig.attn_implementation {self.attn_implementation!r} is not supported")
