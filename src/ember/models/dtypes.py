"""The dtype names a setting may give ('float32', 'bf16', ...), checked without torch.

Settings are checked before torch is imported (`ember serve` with a bad flag exits at once);
`ember.models.loading.resolve_dtype` maps a checked name to its torch dtype.
"""

from __future__ import annotations

import sys
from typing import Any

# accepted name -> the torch dtype's name (`getattr(torch, ...)`)
DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}

# The largest |trainer logprob - sampler logprob| per token (nats) ember states for a compute
# dtype, the trainer and the sampler computing in it on one device: fp32 is contract 5's
# bound; bf16 (8 significant bits) 0.1, as the GPU tests bound bf16 against fp32
# (tests/engine/test_engine_gpu.py); fp16 (11 bits) 0.02. `ember doctor` checks them.
LOGPROB_ATOL = {"float32": 1e-4, "bfloat16": 0.1, "float16": 0.02}


def dtype_name(dtype: Any) -> str:
    """The torch name of a dtype setting ('bf16' -> 'bfloat16'; a torch dtype itself ->
    its name); ValueError naming the accepted names for anything else."""
    torch = sys.modules.get("torch")  # a torch dtype exists only once torch is imported
    if torch is not None and isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_NAMES)}") from None
