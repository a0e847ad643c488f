"""Memory accounting of the objects a rank holds (engines, samplers).

`state_bytes(obj)` counts the bytes of an object's *state*: model parameters, their
gradients and the optimizer's tensors, local shards only (a DTensor counts its
`_local_tensor`, so FSDP2 at world 2 counts about half of world 1). LoRA engines count
only their trainable parameters (the frozen base model is shared, and is not what
`offload` moves). Objects can override the whole computation by defining
`state_bytes() -> dict`.
"""

from __future__ import annotations

from typing import Any

import torch


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds (DTensor) or the tensor itself."""
    return getattr(t, "_local_tensor", t)


def tensor_bytes(t: Any) -> int:
    if not torch.is_tensor(t):
        return 0
    lt = local_tensor(t)
    return int(lt.numel() * lt.element_size())


def _parameters(obj: Any) -> list[torch.Tensor]:
    model = getattr(obj, "model", None)
    if not isinstance(model, torch.nn.Module):
        return []
    params = list(model.parameters())
    if getattr(obj, "is_lora", False):
        params = [p for p in params if p.requires_grad]
    return params


def _optimizer_bytes(obj: Any) -> int:
    opt = getattr(obj, "optimizer", None)
    if opt is None:
        return 0
    return sum(tensor_bytes(v) for state in opt.state.values() for v in state.values())


def state_bytes(obj: Any) -> dict[str, int]:
    """{"params", "grads", "optimizer", "total"} in bytes for one object on this rank."""
    custom = getattr(obj, "state_bytes", None)
    if callable(custom):
        out = dict(custom())
        out.setdefault("total", sum(v for k, v in out.items() if k != "total"))
        return out
    params = _parameters(obj)
    out = {
        "params": sum(tensor_bytes(p) for p in params),
        "grads": sum(tensor_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": _optimizer_bytes(obj),
    }
    out["total"] = sum(out.values())
    return out


def process_rss_bytes() -> int:
    """Current resident set size of this process (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        import os

        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_cached_memory(device: torch.device) -> bool:
    """Hand the blocks torch's CUDA allocator keeps cached back to the driver after an
    offload (True), so another process (a vLLM engine colocated on this GPU) can use them:
    freed tensors stay reserved by this process until `torch.cuda.empty_cache()`. Nothing
    to do on the CPU (False)."""
    if torch.device(device).type != "cuda":
        return False
    torch.cuda.empty_cache()
    return True
