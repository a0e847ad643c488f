"""Measure one training step's peak host memory in a fresh process (CPU engines).

    python -m ember.engine.memory_probe --model DIR --tokens N [--chunk C] [--lora-rank R]
        [--mode engine|hf-labels] [--steps S] [--dtype float32]

prints one JSON line: `rss_before_load` (bytes resident after the imports, before the
model is loaded), `peak_rss` (`VmHWM` of /proc/self/status: this process's own resident
high-water mark), `model_peak` (their difference: what `ember.engine.estimate` predicts)
and `seconds` per step.

Not `getrusage(RUSAGE_SELF).ru_maxrss`: Linux carries a process's maxrss across execve
(the old address space's high-water mark is folded into it), and Python's subprocess
forks (vfork) the caller, so the probe's ru_maxrss starts at the *parent's* peak — under
pytest-xdist a worker that has run other heavy tests, 946 MB where the probe itself
peaked at ~0.5 GB. VmHWM belongs to the address space exec made, so it is the probe's alone.
`engine`: `TorchEngine.forward_backward` on one datum of N tokens (cross_entropy), then
`optim_step`, S times (so the optimizer state exists at the second step's peak);
`hf-labels`: transformers' own `model(input_ids, labels=...)` loss and backward, for
comparison. Run it in a subprocess per configuration (a peak can only go up), under
`prlimit --as` to see whether a configuration fits a memory cap.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.engine.estimate import load_config
from ember.models import load_model


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _status(key: str) -> int:
    """A `/proc/self/status` size (kB there) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {key} in /proc/self/status")


def _datum(tokens: int, vocab: int, seed: int = 0) -> types.Datum:
    """A next-token datum of `tokens` random tokens, every position trained."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (tokens + 1,), generator=g)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1].tolist()),
                       loss_fn_inputs={"target_tokens": ids[1:].clone(), "weights": torch.ones(tokens)})


def _engine_steps(args, vocab: int) -> float:
    config = EngineConfig(micro_batch_tokens=args.tokens, logprob_chunk_tokens=args.chunk, dtype=args.dtype,
                          activation_checkpointing=args.activation_checkpointing)
    lora = types.LoraConfig(rank=args.lora_rank) if args.lora_rank else None
    engine = TorchEngine.from_pretrained(args.model, config, lora)
    datum = _datum(args.tokens, vocab)
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.forward_backward([datum], "cross_entropy")
        engine.optim_step(types.AdamParams(learning_rate=1e-4))
    return (time.perf_counter() - start) / args.steps


def _hf_steps(args, vocab: int) -> float:
    model = load_model(args.model, args.dtype).eval()
    ids = torch.randint(0, vocab, (1, args.tokens + 1), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss * args.tokens
        loss.backward()
        model.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / args.steps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ember.engine.memory_probe")
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--chunk", type=int, default=1024, help="EngineConfig.logprob_chunk_tokens (0 = off)")
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--mode", choices=["engine", "hf-labels"], default="engine")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--as-extra", type=int, default=0, metavar="BYTES",
                   help="cap the address space at its size after the imports plus BYTES (as prlimit --as)")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    vocab = int(load_config(args.model).vocab_size)
    before = _rss()
    if args.as_extra:
        cap = _status("VmSize") + args.as_extra
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    try:
        seconds = (_engine_steps if args.mode == "engine" else _hf_steps)(args, vocab)
    except (MemoryError, RuntimeError) as exc:
        if not isinstance(exc, MemoryError) and "memory" not in str(exc):
            raise
        print(json.dumps({"oom": True, "error": str(exc)[:200]}))
        raise SystemExit(3) from None
    peak = _status("VmHWM")  # not ru_maxrss: it includes the parent's peak (module docstring)
    print(json.dumps({"rss_before_load": before, "peak_rss": peak, "model_peak": peak - before, "seconds": seconds}))


if __name__ == "__main__":
    main()
