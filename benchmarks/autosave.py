"""What `--runs.autosave_every_steps N` costs a training loop (README "Restarts").

Two runs on one in-process service, the same model, data and optimizer, steps interleaved
so that machine noise hits both alike: one with the automatic save every N optim_steps
(weights, optimizer state, step and next seq_id written to the data directory), one
without. A step is forward_backward + optim_step, waited for. Also the time of one save.

    python benchmarks/autosave.py [--every 10] [--steps 20] [--lora-rank 16] [--full]

Last line: `autosave_cost_ratio=<mean step time with autosave / without>` (the amortized
cost: one save's time spread over N steps).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import build_model  # noqa: E402

from tinker import types  # noqa: E402

from helpers.datums import random_sft_datums  # noqa: E402
from ember.service import Service, ServiceConfig  # noqa: E402
from ember.service.config import RunsConfig  # noqa: E402

ADAM = types.AdamParams(learning_rate=1e-4)


def done(svc: Service, sub) -> None:
    state = svc.retrieve("bench", sub.request_id, 600)
    assert state.status == "complete", state.error


def new_run(svc: Service, lora: types.LoraConfig | None) -> str:
    sid = svc.create_session("bench").session_id
    sub = svc.create_model("bench", sid, 0, "m", lora)
    done(svc, sub)
    return sub.model_id


def step(svc: Service, model_id: str, seq: int, data) -> float:
    t0 = time.perf_counter()
    fb = svc.forward_backward("bench", model_id, seq, data, "cross_entropy")
    done(svc, svc.optim_step("bench", model_id, seq + 1, ADAM))
    done(svc, fb)
    return time.perf_counter() - t0


def measure(every: int, steps: int, lora: types.LoraConfig | None, model: str) -> tuple[float, float]:
    """(mean step seconds with the automatic save every `every` steps, without)."""
    times: dict[bool, list[float]] = {True: [], False: []}
    services = {}
    try:
        for saving in (True, False):
            config = ServiceConfig(data_dir=tempfile.mkdtemp(prefix="ember-bench-autosave-"), models={"m": model},
                                   runs=RunsConfig(autosave_every_steps=every if saving else 0))
            services[saving] = Service(config)
        runs = {saving: new_run(svc, lora) for saving, svc in services.items()}
        data = random_sft_datums(4, 84, min_len=32, max_len=64, seed=0)  # the tiny tokenizer: 84 tokens
        for i in range(steps + 2):  # the first two of each are warm-up
            for saving, svc in services.items():
                took = step(svc, runs[saving], 1 + 2 * i, data)
                if i >= 2:
                    times[saving].append(took)
    finally:
        for svc in services.values():
            svc.close()
    return statistics.mean(times[True]), statistics.mean(times[False])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20, help="measured steps per run (a multiple of --every)")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    model = build_model(hidden=args.hidden, layers=args.layers)
    lora = None if args.full else types.LoraConfig(rank=args.lora_rank)
    with_save, without = measure(args.every, args.steps, lora, model)
    print(f"model: hidden {args.hidden}, {args.layers} layers; {'full fine-tuning' if args.full else f'LoRA rank {args.lora_rank}'}")
    print(f"step without autosave: {without * 1e3:.1f} ms; with autosave every {args.every}: {with_save * 1e3:.1f} ms "
          f"(one save ~{(with_save - without) * args.every * 1e3:.0f} ms)")
    print(f"autosave_cost_ratio={with_save / without:.3f}")


if __name__ == "__main__":
    main()
