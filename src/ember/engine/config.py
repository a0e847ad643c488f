"""`EngineConfig`: everything a TorchEngine needs to know besides its model."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ember.models.dtypes import dtype_name


def check_moe_aux_loss_coef(coef: object) -> None:
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef) or coef < 0:
        raise ValueError(f"EngineConfig.moe_aux_loss_coef must be a finite number >= 0 (0 = off), got {coef!r}")


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
    logprob_chunk_tokens: the policy head runs the LM head, fp32 log-softmax and target
        gather over chunks of this many tokens, recomputed in backward, so no (T, vocab)
        tensor is held for a micro-batch (`ember.engine.heads.chunked_target_logprobs`);
        0 = off (full logits, as transformers computes them). Results are equal either way.
        Under tensor parallelism each rank's logits are its slice of the vocabulary, chunked
        or not (`ember.engine.vocab_parallel`).
    activation_checkpointing: recompute each decoder layer's activations in backward
        (any engine; under a mesh it is applied before FSDP2). Keeps one hidden state per
        layer instead of every intermediate: less memory, about one more forward of time.
    activation_offload: CUDA only: tensors saved for backward are kept in pinned host
        memory (`torch.autograd.graph.save_on_cpu`) and copied back in backward.
    optimizer_offload: CUDA only: the optimizer state (AdamW moments, Dimuon momentum)
        lives in host memory between steps and visits the device for `optim_step` only.
    train_vision: a vision-language model's tower is trained too (full fine-tuning of its
        weights) in a full fine-tuning run; off, the tower is frozen and only the language
        model learns. LoRA adapters never go on the tower, and a LoRA run with it on is
        refused (the tower's weights are the shared base model's).
    moe_aux_loss_coef: a mixture-of-experts model's load-balancing loss, added (times this
        coefficient) to every forward_backward's loss: per sequence and layer, E/(kT) x
        sum over experts of (tokens routed there) x (mean router probability), summed
        (`ember.engine.moe`); 0 (the default) = off. Reported as `moe_aux_loss:sum`, apart
        from `loss:sum`.
    compile: regional `torch.compile` (`ember.engine.compile`): each decoder layer once, the
        policy head's chunks and the losses, with dynamic shapes (no recompilation per
        sequence length). Values equal eager's to rounding (fp32 CPU: rtol 1e-5). The
        engine compiles at start (a warm-up forward and backward; its seconds are logged and
        in the engine info's `extra["compile"]`). Single device, FSDP2, TP and CP; refused
        with expert parallelism and activation checkpointing.
    compile_cache_dir: inductor's on-disk cache (TORCHINDUCTOR_CACHE_DIR), so a restart does
        not compile again; "" = `<data_dir>/compile-cache` under `ember serve`, else
        torch's default.
    batch_invariant: run the model's forward with row-invariant kernels
        (`ember.models.batch_invariant`): with `SamplerConfig.batch_invariant` too, the
        trainer's logprobs equal TorchSampler's bitwise (fp32 or not, any batch). Much
        slower; one device only (refused with compile and under a parallel layout).
    float8: CUDA only (compute capability >= 8.9), full fine-tuning only: the decoder's
        `nn.Linear` layers train through torchao's float8 linear layers (`ember.engine.float8`:
        converted before compile and FSDP2; float8 all-gather under FSDP2). Layers with a
        dimension not divisible by 16, lm_head, a MoE router and the embedding stay in
        high precision. Needs torchao (`pip install torchao`).
    """

    micro_batch_tokens: int = 8192
    dtype: str = "float32"
    autocast_dtype: str | None = None
    device: str = "cpu"
    packing: bool = True
    attn_implementation: str = "sdpa"
    seed: int = 0
    backend: str = "torch"
    logprob_chunk_tokens: int = 1024
    activation_checkpointing: bool = False
    activation_offload: bool = False
    optimizer_offload: bool = False
    train_vision: bool = False
    moe_aux_loss_coef: float = 0.0
    compile: bool = False
    compile_cache_dir: str = ""
    batch_invariant: bool = False
    float8: bool = False

    def __post_init__(self) -> None:
        from ember.engine.registry import ENGINE_BACKENDS

        check_moe_aux_loss_coef(self.moe_aux_loss_coef)
        if self.backend not in ENGINE_BACKENDS:
            raise ValueError(f"EngineConfig.backend {self.backend!r} is unknown; known: {', '.join(ENGINE_BACKENDS)}")
        if self.micro_batch_tokens < 1:
            raise ValueError(f"EngineConfig.micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        chunk = self.logprob_chunk_tokens
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"EngineConfig.logprob_chunk_tokens must be an integer >= 0 (0 = off), got {chunk!r}")
        for name in ("activation_offload", "optimizer_offload"):
            if getattr(self, name) and not self.device.startswith("cuda"):
                raise ValueError(f"EngineConfig.{name} needs a CUDA device (it moves memory from the GPU to the host); "
                                 f"device is {self.device!r}")
        dtype_name(self.dtype)
        if self.autocast_dtype is not None and dtype_name(self.autocast_dtype) not in ("bfloat16", "float16"):
            raise ValueError(f"EngineConfig.autocast_dtype must be None, 'bfloat16' or 'float16', got {self.autocast_dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"EngineConfig.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.compile and self.activation_checkpointing:
            raise ValueError("EngineConfig.compile with activation_checkpointing is not supported (the composable "
                             "checkpoint's hooks around a compiled layer are not verified): turn one of them off")
        if self.batch_invariant and self.compile:
            raise ValueError("EngineConfig.batch_invariant with compile is not supported (inductor would fuse and "
                             "reorder the row-invariant reductions): turn one of them off")
        if self.batch_invariant and self.float8:
            raise ValueError("EngineConfig.batch_invariant with float8 is not supported (float8 matmuls scale and "
                             "round per tensor, outside the row-invariant kernels): turn one of them off")
        if self.float8:
            from ember.engine.float8 import check_device

            check_device(self.device)
        if self.attn_implementation not in ("sdpa", "eager", "flash_attention_2", "flex_attention"):
            raise ValueError(f"EngineConfig.attn_implementation {self.attn_implementation!r} is not supported")


def cuda_index(device: str | None) -> int | None:
    """The GPU index a device string names in its process ("cuda" alone: 0, the device a
    process and each new thread start on), or None for the CPU and None."""
    if not device or not device.startswith("cuda"):
        return None
    return int(device.split(":", 1)[1]) if ":" in device else 0
