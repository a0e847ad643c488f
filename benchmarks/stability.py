"""Stability records: the cost of `record()` on the finisher threads, evicting vs not, and
the real bytes per record (tracemalloc) against the accounted ones.

Another owner's `--resident` records are in the store (a busy server); then `--calls`
`record()` calls of one owner, each a sample of 8 sequences x 50 tokens, once with budgets
that evict on every call and once (the baseline) with budgets nothing reaches. Eviction is
O(1) per record, so the two should cost about the same whatever is resident.

    python benchmarks/stability.py [--resident 100000] [--calls 400]

Last line: `record_us_evicting=<x> record_us_baseline=<y> real_bytes_per_record=<b>
accounted_bytes_per_record=<a>`.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import tracemalloc

import numpy as np
from tinker import types

from ember.service.stability import StabilityConfig, StabilityRecords

PROMPT = types.ModelInput.from_ints(list(range(100)))


def sample(tag: str, n: int = 8, length: int = 50) -> types.SampleResponse:
    return types.SampleResponse(sequences=[
        types.SampledSequence(stop_reason="length", sequence_id=f"{tag}-{i}", tokens_np=np.arange(length, dtype=np.int32),
                              logprobs_np=np.full(length, -1.0, np.float32)) for i in range(n)])


def fill(records: StabilityRecords, resident: int) -> None:
    for i in range(resident // 8):
        records.record("resident", f"sess-r{i % 100}", PROMPT, sample(f"r{i}"))


def time_calls(records: StabilityRecords, calls: int) -> float:
    samples = [sample(f"c{i}") for i in range(calls)]
    start = time.perf_counter()
    for i, s in enumerate(samples):
        records.record("caller", "sess-c", PROMPT, s)
    return (time.perf_counter() - start) / calls * 1e6


def bytes_per_record(count: int = 2000) -> tuple[float, float]:
    records = StabilityRecords()
    samples = [sample(f"m{i}") for i in range(count // 8)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i, s in enumerate(samples):
        records.record("m", f"sess-{i % 10}", types.ModelInput.from_ints(list(range(100))), s)
    del samples, s
    gc.collect()
    real = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return real / len(records), records.bytes_used() / len(records)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resident", type=int, default=100_000)
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args(argv)
    one_call = StabilityRecords()
    one_call.record("x", "s", PROMPT, sample("x"))
    per_call = one_call.bytes_used()
    results = {}
    for label, budget in (("evicting", 2 * per_call), ("baseline", 1 << 62)):
        records = StabilityRecords(StabilityConfig(max_bytes_per_owner=budget, max_bytes_total=1 << 62))
        fill(records, args.resident)
        results[label] = time_calls(records, args.calls)
        print(f"[{label}] {args.resident} resident records; {args.calls} record() calls of 8 x 50 tokens: "
              f"{results[label]:.1f} us per call; {len(records)} records kept")
    real, accounted = bytes_per_record()
    print(f"record_us_evicting={results['evicting']:.1f} record_us_baseline={results['baseline']:.1f} "
          f"real_bytes_per_record={real:.0f} accounted_bytes_per_record={accounted:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
