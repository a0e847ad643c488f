"""Cost of batch-invariant mode (`EngineConfig.batch_invariant` + `SamplerConfig.batch_invariant`,
src/ember/models/batch_invariant.py) on the tests' tiny Qwen3 (hidden 64, 2 layers), CPU fp32.

(a) forward: `TorchEngine.forward` of 8 sequences of 32 tokens (cross_entropy), mode on vs off.
(b) sample: TorchSampler, 4 prompts (4-16 tokens) x 2 samples x 16 new tokens at temperature 1,
    mode on vs off (the off sampler uses its default direct decode forward).
Median of interleaved repeats, in process CPU time with 1 torch thread (`--threads`), so a
shared machine's other tenants do not move the ratio. Last line:
`batch_invariant_cost=<(on forward + on sample) / (off forward + off sample)>`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from tinker import types

import _common  # noqa: F401,I001 - sets the environment; benchmarks/ is the working directory's sibling

from ember.engine import EngineConfig, TorchEngine
from ember.models.testing import build_tiny_model
from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler


def _cpu_median(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = build_tiny_model(tempfile.mkdtemp(prefix="ember-bench-"), family="qwen3", seed=0)
    g = torch.Generator().manual_seed(0)
    datums = []
    for _ in range(8):
        toks = torch.randint(3, 80, (33,), generator=g).tolist()
        datums.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                                  loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 32}))
    prompts = [torch.randint(3, 80, (n,), generator=g).tolist() for n in (4, 8, 12, 16)]
    requests = [SamplingRequest(prompt=types.ModelInput.from_ints(p), num_samples=2,
                                sampling_params=types.SamplingParams(max_tokens=16, temperature=1.0, seed=i, stop=[]))
                for i, p in enumerate(prompts)]
    results = {}
    for on in (False, True):
        engine = TorchEngine.from_pretrained(model_dir, EngineConfig(batch_invariant=on))
        sampler = TorchSampler.from_pretrained(model_dir, SamplerConfig(batch_invariant=on, prefix_cache_tokens=0))
        results[on] = (_cpu_median(lambda: engine.forward(datums, "cross_entropy"), args.repeats),
                       _cpu_median(lambda: sampler.sample_many(requests, timeout=600), args.repeats))
        sampler.close()
    (f_off, s_off), (f_on, s_on) = results[False], results[True]
    print(f"forward: off {f_off * 1e3:.1f} ms, on {f_on * 1e3:.1f} ms, ratio {f_on / f_off:.1f}")
    print(f"sample:  off {s_off * 1e3:.1f} ms, on {s_on * 1e3:.1f} ms, ratio {s_on / s_off:.1f}")
    print(f"batch_invariant_cost={(f_on + s_on) / (f_off + s_off):.1f}")


if __name__ == "__main__":
    main()
