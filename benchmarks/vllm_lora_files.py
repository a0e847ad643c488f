"""What keeping files for vLLM LoRA versions costs (`--sampler.weight_sync memory`).

vLLM 0.32 loads a LoRA adapter only from a path (`LoRARequest.lora_path`), so a vLLM
sampler writes every LoRA version as a peft adapter directory even in memory mode
(`ember.sampling.vllm_versions.write_lora_version`) and vLLM reads it back once. This
times that round trip (the write, checks included, plus a safetensors read of the
adapter: what vLLM's loader starts from) against the least an in-memory hand-over would
cost (one copy of the same tensors), in one run, for a Qwen3-0.6B-shaped model (hidden
1024, 28 layers, MLP 3072) with a rank-32 adapter on every linear layer of the decoder.
Calls interleaved, `--repeats` each; medians. Last line:
`lora_files_s=<a> lora_memory_s=<b> files_vs_memory=<a/b> adapter_mb=<c>`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import _common  # noqa: F401 - sets the offline environment
from weight_sync import qwen3_config


def adapter(model, rank: int) -> list[tuple[str, torch.Tensor]]:
    """Random lora_A / lora_B for every decoder nn.Linear, in peft's names."""
    items = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            items.append((f"base_model.model.{name}.lora_A.weight", torch.randn(rank, module.in_features) * 0.01))
            items.append((f"base_model.model.{name}.lora_B.weight", torch.randn(module.out_features, rank) * 0.01))
    return items


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from safetensors.torch import load_file
    from tinker import types
    from transformers import AutoModelForCausalLM

    from ember.models.adapter import ADAPTER_WEIGHTS
    from ember.sampling.vllm_versions import remove_version_files, write_lora_version

    torch.manual_seed(0)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(qwen3_config(args.layers))
    items = adapter(meta, args.rank)
    mb = sum(t.numel() * t.element_size() for _, t in items) / 1e6
    lora = types.LoraConfig(rank=args.rank)
    times: dict[str, list[float]] = {"files": [], "memory": []}
    with tempfile.TemporaryDirectory(prefix="ember-bench-lora-") as scratch:
        for _ in range(args.repeats):
            start = time.perf_counter()
            version = write_lora_version(1, meta, items, lora, torch.float32, args.rank, Path(scratch))
            assert len(load_file(version.path / ADAPTER_WEIGHTS)) == len(items)
            times["files"].append(time.perf_counter() - start)
            remove_version_files(version.path)
            start = time.perf_counter()
            kept = {n: t.clone() for n, t in items}
            times["memory"].append(time.perf_counter() - start)
            del kept
    files_s, memory_s = statistics.median(times["files"]), statistics.median(times["memory"])
    print(f"lora_files_s={files_s:.3f} lora_memory_s={memory_s:.3f} files_vs_memory={files_s / memory_s:.1f} "
          f"adapter_mb={mb:.1f}")


if __name__ == "__main__":
    main()
