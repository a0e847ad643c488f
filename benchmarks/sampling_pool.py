"""A pool of sampler replicas: 1 vs 2 replicas, session-affine vs round-robin routing.

`--sessions` sampling sessions (64) each send `--turns` requests (4) one after another,
all sessions at once (in a new order every turn, as their replies come back): every request of a session is its own `--prefix`-token prefix (a
conversation so far) plus 8 new tokens, 8 tokens sampled. The model is the tiny Qwen3 of
`_common.build_model` (hidden 256, 4 layers), fp32 on CPU, TorchSampler replicas with
their prefix cache (`SamplerConfig.prefix_cache_tokens`).

Phases, each on fresh prompts (no cache carried over), wall-clock seconds:
* `one`: today's replicas=1 sampler (in this process, no pool);
* `affine`: a 2-replica pool, session-affine routing (ember.sampling.router.SessionRouter);
* `roundrobin`: the same pool, each request to the next replica (RoundRobinRouter).
The hit rate is prompt tokens served from the prefix cache / prompt tokens. On a 2-core
machine two replica processes share the cores with the caller: throughput cannot double.

Last line: `replicas2_vs_1=<one s / affine s> affinity_hit_rate=<a> roundrobin_hit_rate=<r>`.
"""

from __future__ import annotations

import argparse
import random
import time

from tinker import types

from _common import build_model  # noqa: I001 - benchmarks/ is the working directory's sibling

from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler
from ember.sampling.pool import SamplerPool
from ember.sampling.router import RoundRobinRouter, SessionRouter


def _prompts(sessions: int, turns: int, prefix: int, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(sessions):
        head = [rng.randrange(3, 80) for _ in range(prefix)]
        out.append([head + [rng.randrange(3, 80) for _ in range(8 * (t + 1))] for t in range(turns)])
    return out


def _run(sampler, prompts: list[list[list[int]]], tag: str) -> tuple[float, float]:
    """All sessions at once, each session's turns in order, the sessions in a new order
    every turn (as replies arrive); (seconds, cache hit rate)."""
    order = list(range(len(prompts)))
    shuffle = random.Random(7).shuffle
    start = time.perf_counter()
    hits = total = 0
    for turn in range(len(prompts[0])):
        shuffle(order)
        reqs = [SamplingRequest(prompt=types.ModelInput.from_ints(prompts[i][turn]), session=f"{tag}-{i}",
                                sampling_params=types.SamplingParams(max_tokens=8, seed=i, stop=[]))
                for i in order]
        for req, resp in zip(reqs, sampler.sample_many(reqs, timeout=600)):
            if isinstance(resp, Exception):
                raise resp
            hits += resp.prompt_cache_hit_tokens or 0
            total += req.prompt.length
    return time.perf_counter() - start, hits / total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prefix", type=int, default=64)
    args = ap.parse_args()
    model = build_model()
    cfg = SamplerConfig(max_slots=64, max_len=512, prefix_cache_tokens=args.sessions * 256)
    with TorchSampler.from_pretrained(model, cfg) as one:
        _run(one, _prompts(4, 2, args.prefix, seed=99), "warm")
        one_s, one_hit = _run(one, _prompts(args.sessions, args.turns, args.prefix, seed=1), "one")
    pool = SamplerPool(model, SamplerConfig(**{**cfg.__dict__, "replicas": 2}))
    try:
        _run(pool, _prompts(4, 2, args.prefix, seed=98), "warm")
        affine_s, affine_hit = _run(pool, _prompts(args.sessions, args.turns, args.prefix, seed=2), "affine")
        pool.use_router(RoundRobinRouter)
        rr_s, rr_hit = _run(pool, _prompts(args.sessions, args.turns, args.prefix, seed=3), "rr")
        pool.use_router(SessionRouter)
    finally:
        pool.close()
    print(f"one_replica_s={one_s:.2f} one_replica_hit_rate={one_hit:.3f}")
    print(f"pool2_affine_s={affine_s:.2f} pool2_roundrobin_s={rr_s:.2f}")
    print(f"replicas2_vs_1={one_s / affine_s:.2f} affinity_hit_rate={affine_hit:.3f} "
          f"roundrobin_hit_rate={rr_hit:.3f}")


if __name__ == "__main__":  # replicas are spawned processes: they re-import this module
    main()
