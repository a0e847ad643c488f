"""`EngineConfig`: everything a TorchEngine needs to know besides its model."""

from __future__ import annotations

from dataclasses import dataclass

from ember.models.loading import resolve_dtype


@dataclass
class EngineConfig:
    """Configuration of one training engine.

    micro_batch_tokens: token budget of one packed micro-batch (forward + backward at once).
        A datum longer than the budget forms a micro-batch of its own.
    dtype: parameter/compute dtype. "float32" on CPU; "bfloat16" on GPU (with FSDP2 the
        gradient reduction stays fp32, see ParallelismConfig).
    device: "cpu", "cuda" or "cuda:N".
    packing: True packs sequences into one row with block-diagonal attention (via
        position_ids); False pads each micro-batch to its longest sequence.
    attn_implementation: transformers attention backend ("sdpa", "eager", "flash_attention_2").
    seed: seeds dropout-free training RNG (kept in checkpoints for exact resume).
    """

    micro_batch_tokens: int = 8192
    dtype: str = "float32"
    device: str = "cpu"
    packing: bool = True
    attn_implementation: str = "sdpa"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.micro_batch_tokens < 1:
            raise ValueError(f"EngineConfig.micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        resolve_dtype(self.dtype)
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"EngineConfig.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.attn_implementation not in ("sdpa", "eager", "flash_attention_2", "flex_attention"):
            raise ValueError(f"EngineConfig.attn_implementation {self.attn_implementation!r} is not supported")
