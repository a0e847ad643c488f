"""`EngineConfig.float8`: float8 training of full fine-tuning on GPUs through torchao's float8
linear layers (docs/architecture.md#float8).

What it does, in torchtitan's order: the model's `nn.Linear` modules are swapped for torchao's
`Float8Linear` (`torchao.float8.convert_to_float8_training`) right after loading, before
`torch.compile` (`EngineConfig.compile`) and before FSDP2's `fully_shard`. A `Float8Linear`
keeps its weight in the stored precision (same parameter names, same state dicts and
checkpoints) and casts the weight, the input and the output gradient to float8 with dynamic
per-tensor scales for its three matmuls. Under FSDP2 the weights are all-gathered in float8
(`Float8LinearConfig.enable_fsdp_float8_all_gather`), and after each optimizer step the
engine computes every weight's float8 scale in one all-reduce
(`torchao.float8.precompute_float8_dynamic_scale_for_fsdp`).

What stays in high precision: the module filter converts only `nn.Linear` modules both of
whose dimensions are divisible by 16 (float8 matmuls need it), and never the output
embedding (`lm_head`: the log-probabilities the losses read), a mixture-of-experts router
(`gate` / `router`: its top-k choice is sensitive to rounding) or the embedding (not an
`nn.Linear`).

Refused, each with a message naming `EngineConfig.float8`: a CPU device (at config time), no
CUDA device at engine start, a GPU of compute capability below 8.9 (float8 matmuls need Ada
or Hopper), LoRA (the adapters wrap `nn.Linear` modules that float8 would replace: not
supported with float8 yet) and torchao missing (`pip install torchao`, or ember's `float8`
extra). torchao is imported only here, on the float8 path.
"""

from __future__ import annotations

from torch import nn

SETTING = "EngineConfig.float8 (--engine.float8)"
MIN_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90): the first GPUs with float8 tensor cores
DIVISOR = 16  # float8 matmuls (torch._scaled_mm) need both dimensions divisible by 16
# Linear modules kept in high precision, by the last part of their name.
HIGH_PRECISION = ("lm_head", "gate", "router")


def check_device(device: str) -> None:
    """Refuse a non-CUDA device (called by EngineConfig)."""
    if not device.startswith("cuda"):
        raise ValueError(f"{SETTING} needs a CUDA GPU of compute capability >= 8.9 (float8 matmuls run on Ada/Hopper "
                         f"tensor cores); device is {device!r}: turn float8 off on the CPU")


def check_lora(is_lora: bool) -> None:
    if is_lora:
        raise ValueError(f"{SETTING}: LoRA is not supported with float8 yet (float8 swaps the model's nn.Linear "
                         f"modules, which the LoRA adapters wrap); use full fine-tuning or turn float8 off")


def check_gpu(device: str) -> None:
    """Refuse a machine without CUDA or with a GPU older than Ada/Hopper."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"{SETTING} needs a CUDA device and torch sees none (device {device!r})")
    index = torch.device(device).index or 0
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(index)
        raise RuntimeError(f"{SETTING} needs GPU compute capability >= 8.9 (float8 matmuls need Ada or Hopper); "
                           f"{device} ({name}) is {major}.{minor}")


def import_torchao():
    """torchao's float8 module, or a clear error telling how to install it."""
    try:
        import torchao.float8 as float8
    except ImportError as exc:
        raise RuntimeError(f"{SETTING} trains through torchao's float8 linear layers and torchao is not installed: "
                           f"pip install torchao (or pip install 'ember[float8]')") from exc
    return float8


def keeps_high_precision(module: nn.Module, fqn: str) -> bool:
    """True for the linear layers the module filter leaves out (see the module docstring)."""
    if not isinstance(module, nn.Linear):
        return True
    if fqn.rsplit(".", 1)[-1] in HIGH_PRECISION:
        return True
    return module.in_features % DIVISOR != 0 or module.out_features % DIVISOR != 0


def module_filter(module: nn.Module, fqn: str) -> bool:
    """`convert_to_float8_training`'s `module_filter_fn`: True converts the module."""
    return not keeps_high_precision(module, fqn)


def convert(model: nn.Module, device: str, fsdp: bool) -> int:
    """Swap the eligible `nn.Linear` modules of `model` for `Float8Linear`, in place, before
    compile and `fully_shard`; returns how many were converted."""
    check_gpu(device)
    float8 = import_torchao()
    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=module_filter)
    return sum(1 for m in model.modules() if isinstance(m, float8.Float8Linear))


def is_converted(model: nn.Module) -> bool:
    """Whether `model` already carries float8 linear layers (without importing torchao)."""
    return any(type(m).__name__ == "Float8Linear" for m in model.modules())


def after_optim_step(model: nn.Module, fsdp: bool) -> None:
    """Under FSDP2 with float8 all-gather: every weight's float8 scale in one all-reduce, once
    per step, after the optimizer changed the weights (torchao's documented order)."""
    if fsdp:
        import_torchao().precompute_float8_dynamic_scale_for_fsdp(model)
