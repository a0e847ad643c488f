"""Expert parallelism on CPU gloo: training step time with ep=2 over ep=1, both at world 2.

Same run: one `process` worker group of two ranks, two engines on it — FSDP2 dp_shard=2
with every expert on every rank (ep=1), and dp_shard=2 with ep=2 (each rank holds half of
each layer's experts; tokens go to their experts' rank and back with all-to-all,
`ember.engine.expert_parallel`). Tiny Qwen3-MoE (hidden 128, 2 layers, 4 experts, 2 per
token), 8 sequences x 64 tokens of cross-entropy, `forward_backward` + AdamW `optim_step`,
steps interleaved (`time_interleaved`, median).

`ep2_vs_ep1(steps)` returns ep=2's median step time over ep=1's (> 1: ep=2 is slower).
On a 2-core machine both ranks share the cores with the caller, so the ratio compares
the dispatch's cost (two all-to-alls of token rows per layer, forward and backward) with
FSDP2's all-gather and reduce-scatter of the expert weights, not a parallel speed-up
(two runs on the shared 2-core development host, 5 steps each: 562 / 338 ms, ratio 0.60,
and 412 / 398 ms, ratio 0.97: the machine's load moves it more than the layout). The MoE benchmark
(moe.py beside this file) imports it.
Last line: `ep2_vs_ep1=<ratio>`.
"""

from __future__ import annotations

import tempfile

import torch
from _common import time_interleaved
from tinker import types

from ember.engine import EngineConfig
from ember.engine.parallel import ParallelismConfig
from ember.workers import EngineSpec, GroupEngine, WorkerGroup
from helpers.datums import sft_datum

BATCH, SEQ = 8, 64
ADAM = types.AdamParams(learning_rate=1e-4)


def build_moe_model() -> str:
    from ember.models.testing import build_tiny_model

    out = tempfile.mkdtemp(prefix="ember-bench-moe-")
    build_tiny_model(out, family="qwen3_moe", seed=0, hidden_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=32, max_position_embeddings=512)
    return out


def ep2_vs_ep1(steps: int) -> float:
    """Median training step time at ep=2 over ep=1, both dp_shard=2 at world 2 (gloo)."""
    torch.manual_seed(0)
    model_dir = build_moe_model()
    tokens = torch.randint(0, 80, (BATCH, SEQ + 1))
    datums = [sft_datum(tokens[i].tolist()) for i in range(BATCH)]
    config = EngineConfig(micro_batch_tokens=BATCH * SEQ)
    group = WorkerGroup.create("process", world_size=2)
    try:
        engines = {ep: GroupEngine.create(group, f"ep{ep}",
                                          EngineSpec(model_dir, config, ParallelismConfig(dp_shard=2, ep=ep)))
                   for ep in (1, 2)}

        def step(engine: GroupEngine):
            def run() -> None:
                engine.forward_backward(datums, "cross_entropy")
                engine.optim_step(ADAM)

            return run

        t = time_interleaved({ep: step(e) for ep, e in engines.items()}, repeats=steps, warmup=1)
    finally:
        group.shutdown()
    for ep in (1, 2):
        print(f"ep={ep} (dp_shard=2, world 2): {t[ep] * 1e3:.0f} ms/step")
    return t[2] / t[1]


def main() -> None:
    print(f"ep2_vs_ep1={ep2_vs_ep1(steps=5):.3f}")


if __name__ == "__main__":
    main()
