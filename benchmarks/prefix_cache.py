"""TorchSampler's prefix cache: requests that share a long prompt prefix, cache on vs off.

Each round sends `--requests` requests one after another, each a `--prefix`-token shared
prefix (a system prompt, a few-shot block) plus 16 tokens of its own, 8 new tokens each, on
the tiny Qwen3 of `_common.build_model` (hidden 256, 4 layers) in fp32. With the cache, every request after the first prefills only
its last block-unaligned tokens. Times are process CPU time with 1 torch thread (`--clock
wall` otherwise), medians over interleaved rounds. Last line: `speedup=<off time / on time>`.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from tinker import types

from _common import build_model  # noqa: I001 - benchmarks/ is the working directory's sibling

from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler


def _round(sampler: TorchSampler, prompts: list[list[int]]) -> int:
    hits = 0
    for i, p in enumerate(prompts):
        params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=i)
        resp = sampler.submit(SamplingRequest(prompt=types.ModelInput.from_ints(p), sampling_params=params)).result()
        hits += resp.prompt_cache_hit_tokens
    return hits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    model_dir = build_model(hidden=256, layers=4, heads=8, kv_heads=4)
    rng = np.random.default_rng(0)
    samplers = {
        "off": TorchSampler.from_pretrained(model_dir, SamplerConfig(max_slots=8, prefix_cache_tokens=0)),
        "on": TorchSampler.from_pretrained(model_dir, SamplerConfig(max_slots=8, prefix_cache_tokens=4 * args.prefix)),
    }
    times: dict[str, list[float]] = {k: [] for k in samplers}
    for r in range(args.rounds + 1):  # round 0 warms up
        prefix = rng.integers(1, 80, size=args.prefix).tolist()
        prompts = [prefix + rng.integers(1, 80, size=16).tolist() for _ in range(args.requests)]
        for name, sampler in samplers.items():
            t0 = clock()
            hits = _round(sampler, prompts)
            if r:
                times[name].append(clock() - t0)
            print(f"round {r} cache={name}: {clock() - t0:.3f}s prompt_cache_hit_tokens={hits}")
    off, on = float(np.median(times["off"])), float(np.median(times["on"]))
    for s in samplers.values():
        s.close()
    print(f"median s per round: off={off:.3f} on={on:.3f}")
    print(f"speedup={off / on:.2f}")


if __name__ == "__main__":
    main()
