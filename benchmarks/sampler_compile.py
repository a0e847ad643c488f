"""TorchSampler decode, `[sampler.torch] compile` on vs off (`SamplerConfig.compile`).

Both samplers serve the tiny Qwen3 of `_common.build_model` in fp32; each round sends
`--rows` greedy requests together (prompts of 8-40 tokens, `--tokens` new tokens each).
Warm-up rounds (batch sizes 1..rows, so every graph is compiled) run first and are not
timed; their compile seconds (inductor's, `debug_state()["compile"]`) are printed before the
timed rounds. Decode tokens/s = generated tokens / process CPU time of a round (1 torch
thread), medians over interleaved rounds. Last line: `decode_compile_vs_eager=<compiled
tokens/s / eager tokens/s>`.

`--cuda-graphs` (CUDA only; without a GPU it says so on stderr and exits 0 with no
figure): the same rounds on `cuda`, bf16, `[sampler.torch] cuda_graphs` on vs off, timed
by wall clock (the GPU works asynchronously); warm-up rounds capture the graphs. Last
line: `decode_cuda_graphs_vs_eager=<graphs tokens/s / eager tokens/s>`.
"""

from __future__ import annotations

import argparse
import sys
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


def _round(sampler: TorchSampler, requests: list[SamplingRequest], clock=time.process_time) -> tuple[float, int]:
    t0 = clock()
    responses = sampler.sample_many(requests, timeout=600)
    return clock() - t0, sum(len(r.sequences[0].tokens) for r in responses)


def _timed_rounds(samplers: dict[str, TorchSampler], rng, args, clock, unit: str) -> dict[str, float]:
    """Median tokens/s of each sampler over `args.rounds` interleaved rounds."""
    rates: dict[str, list[float]] = {k: [] for k in samplers}
    for r in range(args.rounds):
        requests = _requests(rng, args.rows, args.tokens)
        for name, sampler in samplers.items():
            seconds, tokens = _round(sampler, requests, clock)
            rates[name].append(tokens / seconds)
            print(f"round {r} {name}: {tokens} tokens in {seconds:.3f}s {unit} = {tokens / seconds:.1f} tokens/s")
    return {name: float(np.median(v)) for name, v in rates.items()}


def cuda_graphs(args, model_dir) -> None:
    """`--cuda-graphs`: decode tokens/s (wall clock) with and without CUDA graphs, bf16 on cuda."""
    base = dict(max_slots=args.rows, device="cuda", dtype="bfloat16")
    samplers = {"eager": TorchSampler.from_pretrained(model_dir, SamplerConfig(**base)),
                "cuda_graphs": TorchSampler.from_pretrained(model_dir, SamplerConfig(cuda_graphs=True, **base))}
    rng = np.random.default_rng(0)
    for rows in range(1, args.rows + 1):  # every batch bucket once: graphs captured before timing
        for sampler in samplers.values():
            sampler.sample_many(_requests(rng, rows, 4), timeout=600)
    print(f"after warm-up: {samplers['cuda_graphs'].debug_state()['cuda_graphs']}")
    medians = _timed_rounds(samplers, rng, args, time.perf_counter, "wall")
    print(f"after timed rounds: {samplers['cuda_graphs'].debug_state()['cuda_graphs']}")
    for s in samplers.values():
        s.close()
    print(f"median decode tokens/s: eager={medians['eager']:.1f} cuda_graphs={medians['cuda_graphs']:.1f}")
    print(f"decode_cuda_graphs_vs_eager={medians['cuda_graphs'] / medians['eager']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile-cache-dir", default="")
    ap.add_argument("--cuda-graphs", action="store_true", help="CUDA graphs vs eager on cuda (GPU only)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.cuda_graphs and not torch.cuda.is_available():
        print("sampler_compile.py --cuda-graphs needs a CUDA device; none here: no figure", file=sys.stderr)
        return
    model_dir = build_model(hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4)
    if args.cuda_graphs:
        cuda_graphs(args, model_dir)
        return
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
    medians = _timed_rounds(samplers, rng, args, time.process_time, "cpu")
    graphs_after = samplers["compiled"].debug_state()["compile"]["graphs"]
    for s in samplers.values():
        s.close()
    eager, compiled = medians["eager"], medians["compiled"]
    print(f"median decode tokens/s: eager={eager:.1f} compiled={compiled:.1f} "
          f"(graphs compiled during timed rounds: {graphs_after - info['graphs']})")
    print(f"decode_compile_vs_eager={compiled / eager:.3f}")


if __name__ == "__main__":
    main()
