"""Shared helpers for the benchmark scripts (tiny models built in code, timing)."""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")
# The tests' helpers (`helpers.datums`, `helpers.server`) are not shipped in the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def build_model(hidden: int = 256, layers: int = 4, heads: int = 8, kv_heads: int = 4, seed: int = 0) -> str:
    from ember.models.testing import build_tiny_model

    out = tempfile.mkdtemp(prefix="ember-bench-")
    build_tiny_model(out, family="qwen3", seed=seed, hidden_size=hidden, num_layers=layers, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=hidden // heads, max_position_embeddings=4096)
    return out


def time_interleaved(fns: dict[str, Callable[[], None]], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each fn, calls interleaved so machine noise hits all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def left_padded(prompts: list[list[int]], pad_id: int):
    """(input_ids, attention_mask), each (B, longest prompt): prompts left-padded with
    `pad_id`, as HF `generate` wants a batch of different lengths."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask
