"""Peak memory of one long-datum forward_backward: chunked policy head vs unchunked vs
transformers' own `model(labels=...)` loss, on a model with Qwen3's vocabulary (151,936),
2 layers, hidden 256 (random weights), LoRA rank 8, one datum, fp32, CPU.

Each configuration runs in a fresh process (`python -m ember.engine.memory_probe`): its peak
RSS (`VmHWM`, its own high-water mark) less its size after the imports. Every probe's address space is capped at
`--cap-gb` (default 6 GB: the machine is shared) above its size after the imports; a
configuration that needs more fails with an out-of-memory error (cheaply: at its first
allocation past the cap) and its peak is given by the estimator (`ember.engine.estimate`,
within 20% of measured peaks: tests/engine/test_engine_estimate.py), marked `estimated`.
The longest datum that trains within 16 GB, each way, is the estimator's (bisection over
multiples of 256 tokens); a way whose longest is no longer than the longest length run
here is then run at that length under a 16 GB cap (when the host has 18 GB available),
and the line says whether it fit (`measured: fits` / `measured: over the cap`).

Lengths not run (`--tokens`, space- or comma-separated; on the shared 2-core machine one
2k step took minutes) are given by the estimator and marked `estimated, not run`.

Last line: `peak_ratio_8k=<unchunked/chunked> max_tokens_16g_chunked=<n> max_tokens_16g_unchunked=<m>`
plus `time_ratio_2k=<chunked/unchunked seconds per step>` (1.0 = same speed), the load
average, and `fits_16g_<way>=yes|no|not-run` for the check above.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import _common  # noqa: F401  (offline environment variables)

VOCAB, HIDDEN, LAYERS, LORA_RANK, CHUNK = 151936, 256, 2, 8, 1024
GB = 10**9
WAYS = {"chunked": ("engine", CHUNK), "unchunked": ("engine", 0), "hf-labels": ("hf-labels", 0)}


def build(max_tokens: int) -> str:
    from transformers import AutoModelForCausalLM

    from ember.models.testing import tiny_config

    out = tempfile.mkdtemp(prefix="ember-long-context-")
    cfg = tiny_config("qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=4, num_kv_heads=2,
                      head_dim=64, max_position_embeddings=max(max_tokens, 4096))
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def probe(model_dir: str, way: str, tokens: int, cap: int) -> dict:
    mode, chunk = WAYS[way]
    cmd = [sys.executable, "-m", "ember.engine.memory_probe", "--model", model_dir, "--tokens", str(tokens),
           "--chunk", str(chunk), "--lora-rank", str(LORA_RANK), "--mode", mode, "--steps", "1",
           "--as-extra", str(cap)]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = r.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"{way} at {tokens} tokens: {r.stderr[-2000:]}")
    return json.loads(lines[-1])


def estimated(model_dir: str, way: str, tokens: int) -> int:
    from ember.engine import EngineConfig
    from ember.engine.estimate import estimate_memory

    chunk = WAYS[way][1]
    return estimate_memory(model_dir, engine=EngineConfig(logprob_chunk_tokens=chunk), tokens=tokens,
                           lora_rank=LORA_RANK).peak


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def check_longest(model_dir: str, most: dict[str, int], longest_run: int) -> dict[str, str]:
    """Run each way at the estimator's longest datum within 16 GB, under a 16 GB cap, where
    that is no longer than what this run measured anyway (CPU time) and the host has room."""
    out = {}
    for way, tokens in most.items():
        if tokens > longest_run or tokens == 0 or available_bytes() < 18 * GB:
            out[way] = "not-run"
            continue
        got = probe(model_dir, way, tokens, 16 * GB)
        out[way] = "no" if got.get("oom") else "yes"
        peak = "" if got.get("oom") else f", peak {got['model_peak'] / GB:.2f} GB"
        print(f"{tokens:6d} tokens {way:10s} under a 16 GB cap: measured: "
              f"{'over the cap' if got.get('oom') else 'fits'}{peak}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", nargs="+", default=["2048,4096,8192"],
                   help="datum lengths to run, space- or comma-separated (others of 2k-16k: the estimator's figure)")
    p.add_argument("--cap-gb", type=float, default=6.0)
    args = p.parse_args()
    lengths = [int(t) for arg in args.tokens for t in arg.split(",") if t]
    model_dir = build(max(lengths))
    cap = int(args.cap_gb * GB)
    peaks: dict[tuple[str, int], int] = {}
    seconds: dict[tuple[str, int], float] = {}
    for tokens in lengths:
        for way in WAYS:
            got = probe(model_dir, way, tokens, cap)
            est = estimated(model_dir, way, tokens) if way != "hf-labels" else None
            if got.get("oom"):
                peaks[way, tokens] = est if est is not None else peaks["unchunked", tokens]
                src = "estimated (over the cap)" if est is not None else "as unchunked (estimated; over the cap)"
            else:
                peaks[way, tokens], seconds[way, tokens] = got["model_peak"], got["seconds"]
                src = f"measured, {got['seconds']:.1f} s" + (f", estimate {est / GB:.2f} GB" if est else "")
            print(f"{tokens:6d} tokens {way:10s} peak {peaks[way, tokens] / GB:7.2f} GB  ({src})", flush=True)
    for tokens in (t for t in (2048, 4096, 8192, 16384) if t not in lengths):
        for way in ("chunked", "unchunked"):  # not probed (time): the estimator's figure
            peaks[way, tokens] = estimated(model_dir, way, tokens)
            print(f"{tokens:6d} tokens {way:10s} peak {peaks[way, tokens] / GB:7.2f} GB  (estimated, not run)")
    from ember.engine import EngineConfig
    from ember.engine.estimate import longest_datum

    most = {way: longest_datum(16 * GB, model_dir=model_dir, engine=EngineConfig(logprob_chunk_tokens=WAYS[way][1]),
                               lora_rank=LORA_RANK) for way in ("chunked", "unchunked")}
    print(f"longest datum within 16 GB (estimator): chunked {most['chunked']}, unchunked {most['unchunked']}")
    fits = check_longest(model_dir, most, max(lengths))
    ratio = peaks["unchunked", 8192] / peaks["chunked", 8192]
    timed = [t for t in lengths if ("chunked", t) in seconds and ("unchunked", t) in seconds]
    time_ratio = seconds["chunked", timed[0]] / seconds["unchunked", timed[0]] if timed else float("nan")
    load = os.getloadavg()[0]
    print(f"peak_ratio_8k={ratio:.2f} max_tokens_16g_chunked={most['chunked']} "
          f"max_tokens_16g_unchunked={most['unchunked']} time_ratio_{timed[0] // 1024 if timed else 0}k={time_ratio:.3f} "
          f"load_avg={load:.1f} " + " ".join(f"fits_16g_{way}={v}" for way, v in fits.items()))


if __name__ == "__main__":
    main()
