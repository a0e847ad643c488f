"""Mixture-of-experts ratios, one run (docs/architecture.md#mixture-of-experts):

* `grouped_vs_loop`: seconds of one training step (forward + backward of a batch) of a
  Qwen3-MoE model with transformers' `experts_implementation="grouped_mm"` (tokens sorted
  by expert, one grouped matmul per expert weight; torch's grouped_mm, or transformers'
  fallback where torch has no kernel for the device) over the same step with "eager"
  (transformers' per-expert Python loop, ember's default). Below 1: grouped is faster.
  The two steps' losses are checked equal first.
* `ep2_vs_ep1`: step time at expert parallelism 2 over 1, both at 2 ranks on gloo
  (`moe_ep.py`'s `ep2_vs_ep1`, which also runs alone).
* `replay_gap_ratio`: after full fine-tuning steps moved the router (and everything else),
  mean |trainer logprob - sampler logprob| over the sampled tokens with routing replay
  over the same without (`ember.engine.moe.RouteReplay`, routes from TorchSampler's
  records). Below 1: replay brings the trainer closer to what the sampler computed.

    python benchmarks/moe.py [--hidden 128] [--layers 2] [--tokens 512] [--repeats 3] [--steps 2] [--ep-steps 3]

Last line: `grouped_vs_loop=<r> ep2_vs_ep1=<r> replay_gap_ratio=<r>`.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from _common import time_interleaved
from moe_ep import ep2_vs_ep1
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.engine.moe import ROUTES_KEY
from ember.models.testing import build_tiny_model
from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler
from helpers.datums import random_sft_datums, sft_datum


def build(hidden: int, layers: int) -> str:
    out = tempfile.mkdtemp(prefix="ember-bench-moe-")
    build_tiny_model(out, family="qwen3_moe", seed=0, hidden_size=hidden, num_layers=layers, num_heads=4,
                     num_kv_heads=2, head_dim=hidden // 4, max_position_embeddings=4096)
    return out


def grouped_vs_loop(model_dir: str, tokens: int, repeats: int) -> float:
    from transformers import AutoModelForCausalLM

    models = {impl: AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation=impl, dtype=torch.float32)
              for impl in ("grouped_mm", "eager")}
    ids = torch.randint(0, 80, (4, tokens // 4), generator=torch.Generator().manual_seed(0))

    def step(model) -> float:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return float(loss.detach())

    losses = {impl: step(m) for impl, m in models.items()}
    if not math.isclose(losses["grouped_mm"], losses["eager"], rel_tol=1e-4):
        raise SystemExit(f"grouped and loop experts disagree: losses {losses}")
    times = time_interleaved({impl: (lambda m=m: step(m)) for impl, m in models.items()}, repeats, warmup=1)
    print(f"training step of {tokens} tokens: grouped_mm {times['grouped_mm'] * 1e3:.1f} ms, "
          f"loop {times['eager'] * 1e3:.1f} ms", file=sys.stderr)
    return times["grouped_mm"] / times["eager"]


def _datum(prompt: list[int], seq, replay: bool) -> types.Datum:
    datum = sft_datum(prompt + list(seq.tokens))
    if not replay:
        return datum
    routes = np.concatenate([seq.prompt_routes_np, seq.routes_np]).astype(np.int64)
    return types.Datum(model_input=datum.model_input,
                       loss_fn_inputs=dict(datum.loss_fn_inputs) | {ROUTES_KEY: types.TensorData.from_numpy(routes)})


def replay_gap_ratio(model_dir: str, steps: int) -> float:
    prompts = [[5 + i, 20 + i, 31, 40 + i, 9] for i in range(8)]
    with TorchSampler.from_pretrained(model_dir, SamplerConfig(max_slots=32)) as sampler:
        requests = [SamplingRequest(prompt=types.ModelInput.from_ints(p), num_samples=1,
                                    sampling_params=types.SamplingParams(max_tokens=16, seed=i, stop=[]))
                    for i, p in enumerate(prompts)]
        sampled = [(p, s) for p, r in zip(prompts, sampler.sample_many(requests, timeout=600)) for s in r.sequences]
    engine = TorchEngine.from_pretrained(model_dir, EngineConfig())  # full fine-tuning: the router trains
    for k in range(steps):
        engine.forward_backward(random_sft_datums(8, 80, min_len=16, max_len=32, seed=k), "cross_entropy")
        engine.optim_step(types.AdamParams(learning_rate=1e-3))

    def gap(replay: bool) -> float:
        outs = engine.forward([_datum(p, s, replay) for p, s in sampled], "cross_entropy").loss_fn_outputs
        diffs = [np.abs(o["logprobs"].to_numpy()[len(p) - 1:] - s.logprobs_np) for o, (p, s) in zip(outs, sampled)]
        return float(np.concatenate(diffs).mean())

    with_replay, without = gap(True), gap(False)
    print(f"trainer/sampler logprob gap after {steps} steps (mean abs, {sum(len(s.tokens) for _, s in sampled)} "
          f"tokens): replay {with_replay:.5f}, no replay {without:.5f}", file=sys.stderr)
    return with_replay / without


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per training step (grouped vs loop)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="full fine-tuning steps between sampling and replay")
    ap.add_argument("--ep-steps", type=int, default=3, help="timed training steps at each expert-parallel layout")
    args = ap.parse_args()
    torch.manual_seed(0)
    model_dir = build(args.hidden, args.layers)
    grouped = grouped_vs_loop(model_dir, args.tokens, args.repeats)
    ep = ep2_vs_ep1(steps=args.ep_steps)
    ratio = replay_gap_ratio(model_dir, args.steps)
    print(f"grouped_vs_loop={grouped:.3f} ep2_vs_ep1={ep:.3f} replay_gap_ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
