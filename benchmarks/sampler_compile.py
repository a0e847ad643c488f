"""TorchSampler decode, `[sampler.torch] compile` on vs off (`SamplerConfig.compile`).

Both samplers serve the tiny Qwen3 of `_common.build_model` in fp32; each round sends
`--rows` greedy requests together (prompts of 8-40 tokens, `--tokens` new tokens each).
Warm-up rounds (batch sizes 1..rows, so every graph is compiled) run first and are not
timed; their compile seconds (inductor's, `debug_state()["compile"]`) are printed before the
timed rounds. Decode tokens/s = generated tokens / process CPU time of a round (1 torch
thread), medians over interleaved rounds. Last line: `decode_compile_vs_eager=<compiled
tokens/s / eager tokens/s>`.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from tinker import types

from _common import build_model  # noqa: I001 - benchmarks/ is the working directory's sibling

from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler


def _requests(rng, rows: int, tokens: int) -> list[SamplingRequest]:
    params = types.SamplingParams(max_tokens=tokens, temperature=0.0, stop=[])
    return [SamplingRequest(prompt=types.ModelInput.from_ints(rng.integers(1, 80, size=int(rng.integers(8, 41))).tolist()),
                            sampling_params=params) for _ in range(rows)]


def _round(sampler: TorchSampler, requests: list[SamplingRequest]) -> tuple[float, int]:
    t0 = time.process_time()
    responses = sampler.sample_many(requests, timeout=600)
    return time.process_time() - t0, sum(len(r.sequences[0].tokens) for r in responses)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile-cache-dir", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = build_model(hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4)
    samplers = {
        "eager": TorchSampler.from_pretrained(model_dir, SamplerConfig(max_slots=args.rows)),
        "compiled": TorchSampler.from_pretrained(model_dir, SamplerConfig(
            max_slots=args.rows, compile=True, compile_cache_dir=args.compile_cache_dir)),
    }
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for rows in range(1, args.rows + 1):  # every batch size once: all graphs compiled before timing
        for sampler in samplers.values():
            sampler.sample_many(_requests(rng, rows, 4), timeout=600)
    info = samplers["compiled"].debug_state()["compile"]
    print(f"warm-up {time.perf_counter() - t0:.1f}s wall; compile_graphs={info['graphs']} "
          f"compile_s={info['compile_seconds']:.1f}")
    rates: dict[str, list[float]] = {k: [] for k in samplers}
    for r in range(args.rounds):
        requests = _requests(rng, args.rows, args.tokens)
        for name, sampler in samplers.items():
            seconds, tokens = _round(sampler, requests)
            rates[name].append(tokens / seconds)
            print(f"round {r} {name}: {tokens} tokens in {seconds:.3f}s cpu = {tokens / seconds:.1f} tokens/s")
    graphs_after = samplers["compiled"].debug_state()["compile"]["graphs"]
    for s in samplers.values():
        s.close()
    eager, compiled = float(np.median(rates["eager"])), float(np.median(rates["compiled"]))
    print(f"median decode tokens/s: eager={eager:.1f} compiled={compiled:.1f} "
          f"(graphs compiled during timed rounds: {graphs_after - info['graphs']})")
    print(f"decode_compile_vs_eager={compiled / eager:.3f}")


if __name__ == "__main__":
    main()
