"""Data-parallel scaling on CPU: world 1 vs world 2 with FSDP2 (gloo), through ember.workers.

Same model (Qwen3, hidden 256, 4 layers), same batch (16 sequences × 128 tokens, weighted
cross-entropy), same AdamW, one torch thread per rank; both engines run in `process`
worker groups (so both pay the same pipe/pickle overhead) and steps are interleaved.

Reported per configuration:
* tokens/s of `forward_backward` + `optim_step` (all ranks together);
* peak state bytes per rank: parameters + gradients + AdamW moments, local shards
  (`ember.workers.memory.state_bytes`, tracked by the ranks after every call). FSDP2 at
  world 2 should hold about half of world 1 per rank (a little more: shards are padded).

Last line: `mem_ratio=<world-2 per-rank / world-1> throughput_ratio=<world-2 / world-1>`.
On a 2-core machine the two ranks share the cores with the caller, so throughput_ratio
measures communication + dispatch overhead as much as parallel speed-up.
"""

from __future__ import annotations

import torch
from _common import build_model, time_interleaved
from tinker import types

from ember.engine import EngineConfig
from ember.engine.parallel import ParallelismConfig
from helpers.datums import sft_datum
from ember.workers import EngineSpec, GroupEngine, WorkerGroup

BATCH, SEQ = 16, 128
ADAM = types.AdamParams(learning_rate=1e-4)


def _peak_per_rank(group: WorkerGroup) -> list[int]:
    return [m["peak_tracked_bytes"] for m in group.memory()]


def main() -> None:
    torch.manual_seed(0)
    model_dir = build_model()
    tokens = torch.randint(0, 80, (BATCH, SEQ + 1))
    weights = torch.rand(BATCH, SEQ)
    datums = [sft_datum(tokens[i].tolist(), weights[i].tolist()) for i in range(BATCH)]
    config = EngineConfig(micro_batch_tokens=BATCH * SEQ)

    groups = {1: WorkerGroup.create("process", world_size=1), 2: WorkerGroup.create("process", world_size=2)}
    try:
        engines = {
            w: GroupEngine.create(g, f"w{w}", EngineSpec(model_dir, config, ParallelismConfig.for_world(w)))
            for w, g in groups.items()
        }

        def step(engine: GroupEngine):
            def run() -> None:
                engine.forward_backward(datums, "cross_entropy")
                engine.optim_step(ADAM)

            return run

        t = time_interleaved({w: step(e) for w, e in engines.items()}, repeats=5, warmup=1)
        tps = {w: BATCH * SEQ / t[w] for w in engines}
        for e in engines.values():  # leave gradients + Adam state in place for the memory peak
            e.forward_backward(datums, "cross_entropy")
        peak = {w: _peak_per_rank(g) for w, g in groups.items()}
    finally:
        for g in groups.values():
            g.shutdown()
    for w in (1, 2):
        per_rank = ", ".join(f"{b / 2**20:.2f} MiB" for b in peak[w])
        layout = "FSDP2 dp_shard=2" if w == 2 else "one rank, unsharded"
        print(f"world {w} ({layout}): {tps[w]:,.0f} tokens/s ({t[w] * 1e3:.0f} ms/step); "
              f"peak params+grads+AdamW per rank: {per_rank}")
    mem_ratio = max(peak[2]) / max(peak[1])
    print(f"mem_ratio={mem_ratio:.3f} throughput_ratio={tps[2] / tps[1]:.3f}")


if __name__ == "__main__":
    main()
