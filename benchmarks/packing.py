"""Sequence packing vs padding to the longest, on a variable-length batch (lengths 16–512).

Both run TorchEngine.forward_backward on the same 32 datums in one micro-batch: packed
(bin-packed rows as wide as the longest datum, block-diagonal attention) vs padded (one row
per datum, right-padded). Last line: `ratio=<packed tokens/s ÷ padded tokens/s>`.
"""

from __future__ import annotations

import os

import torch
from _common import build_model, time_interleaved

from ember.engine import EngineConfig, TorchEngine
from helpers.datums import sft_datum

N_DATUMS = 32


def main() -> None:
    # One intra-op thread: on a shared 2-core machine, thread scheduling noise would swamp
    # the difference being measured (pass EMBER_BENCH_THREADS to change).
    torch.set_num_threads(int(os.environ.get("EMBER_BENCH_THREADS", "1")))
    g = torch.Generator().manual_seed(0)
    model_dir = build_model()
    lengths = torch.randint(16, 513, (N_DATUMS,), generator=g).tolist()
    datums = [sft_datum(torch.randint(0, 80, (n + 1,), generator=g).tolist()) for n in lengths]
    n_tokens = sum(lengths)
    budget = n_tokens  # one micro-batch each way: the layout is the only difference
    packed = TorchEngine.from_pretrained(model_dir, EngineConfig(micro_batch_tokens=budget, packing=True))
    padded = TorchEngine.from_pretrained(model_dir, EngineConfig(micro_batch_tokens=budget, packing=False))

    def run(engine):
        return lambda: (engine.forward_backward(datums, "cross_entropy"), engine.clear_gradients())

    t = time_interleaved({"packed": run(packed), "padded": run(padded)}, repeats=3, warmup=1)
    rows = len(__import__("ember.engine.batching", fromlist=["pack_rows"]).pack_rows(lengths, max(lengths)))
    print(f"{N_DATUMS} datums, {n_tokens} tokens, longest {max(lengths)}; packed into {rows} rows vs {N_DATUMS} padded rows")
    print(f"packed: {n_tokens / t['packed']:,.0f} tokens/s; padded: {n_tokens / t['padded']:,.0f} tokens/s")
    print(f"ratio={t['padded'] / t['packed']:.3f}")


if __name__ == "__main__":
    main()
