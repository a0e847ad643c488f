"""TorchSampler throughput and weight-sync cost, each against a baseline in the same run.

(a) generate: 64 prompts (8-32 tokens) x 128 new tokens, sampling at temperature 1,
    no early stop, both sides returning per-token logprobs. TorchSampler (64 slots) vs
    transformers `generate(do_sample=True, output_logits=True)` on the same model
    (left-padded batch; logprobs = log_softmax(logits) at the chosen tokens), on two
    models: the demo's shape (0.3M parameters, where per-step overhead dominates) and a
    2.4M-parameter Qwen3 (where on CPU both sides spend most of the time in the same
    matmuls and the memory-bound attention over the cache). generate_ratio (last line) =
    sampler tokens/s / generate tokens/s on the larger model (target >= 1.5). The
    sampler's own CPU optimisations are part of what is measured (its direct decode
    forward; Linear weights stored column-major, see ember/sampling/layout.py); the
    baseline model is loaded as transformers loads it.
(b) mixed: 192 requests whose max_tokens are log-uniform in [8, 256] (many short, a few
    long, as RL completions are), 32 slots. Continuous batching (all submitted at once)
    vs static batching (the same sampler fed fixed batches of 32, each of which runs
    until its longest member is done with every row computing all along, as in a padded
    batch: each request of a batch gets the batch's largest max_tokens).
    mixed_ratio = static time / continuous time (target >= 2).
(c) sync: full fine-tuning weight sync of a ~50M-parameter model,
    `sampler.load_weights(engine.named_weights(), copy=False)` (named_weights already
    hands over fresh copies) vs a plain `clone()` of the same tensors.
    sync_ratio = sync time / plain-copy time (1.0 = no overhead over the copy itself).
(d) the demo's GRPO sampling step: 16 prompts x 8 completions of <= 5 tokens on a tiny
    (~0.5M-parameter) model; ms per step (printed, not in the last line).

Ratios are computed from process CPU time (`time.process_time`) with 1 torch thread
(`--threads`): on an idle machine that equals wall time, and on a shared one it does not
depend on what the other tenants do (wall times are printed too). With more than one
thread, use `--clock wall`. `--device cuda[:N]` (and `--dtype bfloat16`) runs both sides on a
GPU (the samplers, the HF model, the sync's engine) and times in wall time with
`torch.cuda.synchronize()` at each end: CPU time misses a GPU's work. Last line:
`generate_ratio=<a> mixed_ratio=<b> sync_ratio=<c>`.

`--backend vllm` compares VLLMSampler with TorchSampler and HF `generate` in one run, on the
2.4M-parameter model (head_dim 32, which vLLM's CPU attention needs), in WALL time (vLLM's
engine core is another process with its own threads, so process CPU time would miss it):
(v1) the uniform workload of (a), (v2) the mixed workload of (b) with continuous batching
on both samplers, (v3) LoRA sync: `load_weights` of a rank-8 adapter plus the first request
on it, minus the same request on an adapter already in use (new adapter visible to the
next request), (v4) full fine-tuning swap: a request pinned to a new full version right
after requests on the base, minus the same request on the loaded base (drain + in-place
reload + prefix-cache reset). Last line: `backend=vllm vllm_vs_torch=<x>
vllm_vs_generate=<y> lora_sync_s=<z> full_swap_s=<w>` (x, y: tokens/s ratios on (v1)).
On a 2-core CPU with tiny models everything is overhead-bound: vLLM may lose there.
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

import numpy as np
import torch
from _common import build_model, left_padded
from tinker import types

from ember.models import load_model
from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler


CLOCK = {"fn": time.process_time}
RUN = {"device": "cpu", "dtype": "float32"}  # --device / --dtype


def _sampler_config(**kwargs) -> SamplerConfig:
    """A benchmark sampler's config on the run's device and dtype."""
    return SamplerConfig(device=RUN["device"], dtype=RUN["dtype"], **kwargs)


def _hf_model(model_dir: str):
    """The baseline transformers model, on the run's device and dtype."""
    return load_model(model_dir).eval().to(device=RUN["device"], dtype=getattr(torch, RUN["dtype"]))


def _sync() -> None:
    if RUN["device"].startswith("cuda"):
        torch.cuda.synchronize(RUN["device"])


@contextmanager
def _timer(out: list, wall: list | None = None):
    """Append the elapsed benchmark-clock seconds (and wall seconds) of the block."""
    _sync()
    c0, w0 = CLOCK["fn"](), time.perf_counter()
    yield
    _sync()
    out.append(CLOCK["fn"]() - c0)
    if wall is not None:
        wall.append(time.perf_counter() - w0)


def _prompts(n: int, rng: np.random.Generator, low: int = 8, high: int = 32) -> list[list[int]]:
    return [rng.integers(6, 84, size=int(rng.integers(low, high + 1))).tolist() for _ in range(n)]


def _requests(prompts, max_tokens, seed0=0, n=1):
    return [
        SamplingRequest(prompt=types.ModelInput.from_ints(p), num_samples=n,
                        sampling_params=types.SamplingParams(max_tokens=int(m), seed=seed0 + i, stop=[]))
        for i, (p, m) in enumerate(zip(prompts, max_tokens))
    ]


def _check(results) -> int:
    tokens = 0
    for r in results:
        if isinstance(r, Exception):
            raise r
        tokens += sum(len(s.tokens) for s in r.sequences)
    return tokens


def _hf_generate(model, prompts, new_tokens: int, pad_id: int) -> int:
    ids, mask = left_padded(prompts, pad_id)
    ids, mask = ids.to(model.device), mask.to(model.device)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, output_logits=True,
            return_dict_in_generate=True, pad_token_id=pad_id,
        )
        new = out.sequences[:, ids.shape[1]:]
        logits = torch.stack(out.logits, dim=1).float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(2, new[..., None]).squeeze(-1)
    assert logprobs.shape == new.shape == (len(prompts), new_tokens)
    return new.numel()


def bench_generate(model_dir: str, repeats: int, label: str = "") -> float:
    rng = np.random.default_rng(0)
    prompts = _prompts(64, rng)
    model = _hf_model(model_dir)
    sampler = TorchSampler.from_pretrained(model_dir, _sampler_config(max_slots=64, max_len=256))
    reqs = _requests(prompts, [128] * 64)
    ours, theirs, wall_ours, wall_theirs = [], [], [], []
    _check(sampler.sample_many(reqs[:4]))  # warm-up
    _hf_generate(model, prompts[:4], 4, 0)
    for _ in range(repeats):  # interleaved, so machine noise hits both alike
        with _timer(ours, wall_ours):
            n_ours = _check(sampler.sample_many(reqs))
        with _timer(theirs, wall_theirs):
            n_hf = _hf_generate(model, prompts, 128, 0)
    sampler.close()
    assert n_ours == n_hf == 64 * 128
    a, b = n_ours / float(np.median(ours)), n_hf / float(np.median(theirs))
    wa, wb = n_ours / float(np.median(wall_ours)), n_hf / float(np.median(wall_theirs))
    print(f"(a){label} 64 prompts x 128 tokens: TorchSampler {a:,.0f} tok/s, HF generate {b:,.0f} tok/s, ratio {a / b:.2f} "
          f"(wall: {wa:,.0f} vs {wb:,.0f} tok/s, ratio {wa / wb:.2f})")
    return a / b


def bench_mixed(model_dir: str, repeats: int, slots: int = 32, n: int = 192) -> float:
    rng = np.random.default_rng(1)
    prompts = _prompts(n, rng)
    max_tokens = np.exp(rng.uniform(np.log(8), np.log(256), size=n)).astype(int)
    reqs = _requests(prompts, max_tokens)
    # Static batching: a batch of `slots` requests runs until its longest member is done,
    # every row computing all along (as a padded batch does); the extra tokens are dropped.
    padded = [_requests(prompts[i:i + slots], [max_tokens[i:i + slots].max()] * len(prompts[i:i + slots]), seed0=i)
              for i in range(0, n, slots)]
    sampler = TorchSampler.from_pretrained(model_dir, _sampler_config(max_slots=slots, max_len=320))
    _check(sampler.sample_many(reqs[:4]))
    cont, static, wall_c, wall_s = [], [], [], []
    for _ in range(repeats):  # interleaved
        with _timer(cont, wall_c):
            total = _check(sampler.sample_many(reqs))
        with _timer(static, wall_s):
            for batch in padded:
                _check(sampler.sample_many(batch))
    continuous, static = float(np.median(cont)), float(np.median(static))
    sampler.close()
    print(f"(b) {n} requests, max_tokens log-uniform 8..256 (mean {max_tokens.mean():.0f}), {slots} slots, "
          f"{total} tokens: continuous {continuous:.2f}s, static {static:.2f}s, ratio {static / continuous:.2f} "
          f"(wall: {np.median(wall_c):.2f}s vs {np.median(wall_s):.2f}s; median of {repeats})")
    return static / continuous


def bench_sync(repeats: int) -> float:
    from ember.engine import EngineConfig, TorchEngine

    model_dir = build_model(hidden=768, layers=10, heads=12, kv_heads=4)
    engine = TorchEngine.from_pretrained(model_dir, EngineConfig(device=RUN["device"], dtype=RUN["dtype"]))
    sampler = TorchSampler.from_pretrained(model_dir, _sampler_config(max_slots=4))
    params = sum(p.numel() for p in engine.model.parameters())
    state = engine.model.state_dict()
    syncs, copies, copy_true = [], [], []
    for _ in range(repeats):
        with _timer(syncs):
            version = sampler.load_weights(engine.named_weights(), copy=False)
        del version
        with _timer(copies):
            plain = [t.detach().clone() for t in state.values()]
        del plain
        with _timer(copy_true):
            version = sampler.load_weights(state, copy=True)
        del version
    s, c, ct = (float(np.median(x)) for x in (syncs, copies, copy_true))
    print(f"(c) sync of {params / 1e6:.1f}M params ({params * 4 / 2**20:.0f} MiB): engine.named_weights -> "
          f"load_weights {s * 1e3:.0f} ms, plain clone {c * 1e3:.0f} ms, ratio {s / c:.2f}; "
          f"load_weights(state_dict, copy=True) {ct * 1e3:.0f} ms ({ct / c:.2f}x)")
    sampler.close()
    return s / c


def bench_demo_step(repeats: int) -> None:
    model_dir = build_model(hidden=128, layers=2, heads=4, kv_heads=2)
    sampler = TorchSampler.from_pretrained(model_dir, _sampler_config(max_slots=128, max_len=64))
    params = sum(p.numel() for p in sampler.model.parameters())
    rng = np.random.default_rng(2)
    prompts = _prompts(16, rng, 10, 20)
    reqs = [
        SamplingRequest(prompt=types.ModelInput.from_ints(p), num_samples=8,
                        sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0, seed=i))
        for i, p in enumerate(prompts)
    ]
    _check(sampler.sample_many(reqs))
    times, wall = [], []
    for _ in range(repeats):
        with _timer(times, wall):
            _check(sampler.sample_many(reqs))
    sampler.close()
    print(f"(d) GRPO sampling step, {params / 1e6:.2f}M params, 16 prompts x 8 samples x <=5 tokens: "
          f"{np.median(times) * 1e3:.1f} ms/step (wall {np.median(wall) * 1e3:.1f} ms; median of {repeats})")


def _wall_tokens_per_s(fn, repeats: int) -> float:
    times, tokens = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = fn()
        times.append(time.perf_counter() - t0)
    return tokens / float(np.median(times))


def _lora_weights(model_dir: str, rank: int = 8):
    from ember.engine import EngineConfig, TorchEngine

    cfg = types.LoraConfig(rank=rank, seed=1)
    engine = TorchEngine.from_pretrained(model_dir, EngineConfig(), lora_config=cfg)
    weights = {k: (v + 0.01 * torch.randn_like(v)) for k, v in engine.named_weights()}  # a non-zero adapter
    return weights, cfg


def _latency(sampler, version, prompt) -> float:
    t0 = time.perf_counter()
    sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=8, seed=1, stop=[]),
                   version=version)
    return time.perf_counter() - t0


def bench_vllm_versions(sampler, model_dir: str) -> tuple[float, float]:
    """(v3) LoRA sync and (v4) full fine-tuning swap, in seconds."""
    prompt = [5, 6, 7, 8, 9, 10]
    weights, cfg = _lora_weights(model_dir)
    old = sampler.load_weights(weights.items(), lora_config=cfg)
    _latency(sampler, old, prompt)
    steady = min(_latency(sampler, old, prompt) for _ in range(3))
    t0 = time.perf_counter()
    new = sampler.load_weights(weights.items(), lora_config=cfg)
    load_s = time.perf_counter() - t0
    first = _latency(sampler, new, prompt)
    lora_sync = load_s + first - steady
    full = load_model(model_dir).state_dict()
    version = sampler.load_weights({k: v + 0.001 for k, v in full.items()}.items())
    base = min(_latency(sampler, None, prompt) for _ in range(3))
    swap = _latency(sampler, version, prompt) - base
    print(f"(v3) LoRA rank 8: load_weights {load_s * 1e3:.0f} ms + first request {first * 1e3:.0f} ms vs "
          f"{steady * 1e3:.0f} ms on a loaded adapter: sync {lora_sync:.3f} s")
    print(f"(v4) full version swap: {swap:.3f} s over a {base * 1e3:.0f} ms request on the loaded base")
    return lora_sync, swap


def bench_vllm(model_dir: str, repeats: int) -> str:
    from ember.sampling import VLLMSampler

    rng = np.random.default_rng(0)
    prompts = _prompts(64, rng)
    reqs = _requests(prompts, [128] * 64)
    model = _hf_model(model_dir)
    vllm = VLLMSampler.from_pretrained(model_dir, _sampler_config(backend="vllm", max_slots=64, max_len=320))
    torch_s = TorchSampler.from_pretrained(model_dir, _sampler_config(max_slots=64, max_len=320))
    for s in (vllm, torch_s):
        _check(s.sample_many(reqs[:4], timeout=600))  # warm-up (vLLM: waits for the engine to start)
    rates = {
        "vllm": _wall_tokens_per_s(lambda: _check(vllm.sample_many(reqs)), repeats),
        "torch": _wall_tokens_per_s(lambda: _check(torch_s.sample_many(reqs)), repeats),
        "generate": _wall_tokens_per_s(lambda: _hf_generate(model, prompts, 128, 0), repeats),
    }
    print("(v1) 64 prompts x 128 tokens, wall tok/s: " + ", ".join(f"{k} {v:,.0f}" for k, v in rates.items()))
    mixed_rng = np.random.default_rng(1)
    mixed_prompts = _prompts(192, mixed_rng)
    mixed = _requests(mixed_prompts, np.exp(mixed_rng.uniform(np.log(8), np.log(256), size=192)).astype(int))
    mixed_rates = {name: _wall_tokens_per_s(lambda s=s: _check(s.sample_many(mixed)), max(1, repeats - 1))
                   for name, s in (("vllm", vllm), ("torch", torch_s))}
    print("(v2) 192 mixed-length requests, wall tok/s: " + ", ".join(f"{k} {v:,.0f}" for k, v in mixed_rates.items()))
    torch_s.close()
    lora_sync, swap = bench_vllm_versions(vllm, model_dir)
    vllm.close()
    return (f"backend=vllm vllm_vs_torch={rates['vllm'] / rates['torch']:.2f} "
            f"vllm_vs_generate={rates['vllm'] / rates['generate']:.2f} lora_sync_s={lora_sync:.3f} full_swap_s={swap:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["torch", "vllm"], default="torch",
                    help="vllm: compare VLLMSampler with TorchSampler and HF generate (wall time)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (a GPU run times wall clock)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    RUN.update(device=args.device, dtype=args.dtype)
    wall = args.clock == "wall" or args.device != "cpu"
    CLOCK["fn"] = time.perf_counter if wall else time.process_time
    model_dir = build_model(hidden=256, layers=4, heads=8, kv_heads=4)
    if args.backend == "vllm":
        print("wall time; torch threads in this process:", args.threads, "(vLLM's engine process uses its own)")
        print(bench_vllm(model_dir, args.repeats))
        return
    n_params = sum(p.numel() for p in load_model(model_dir).parameters())
    print(f"model for (a)/(b): Qwen3 hidden 256, 4 layers, {n_params / 1e6:.1f}M params; "
          f"torch threads {args.threads}, clock {'wall' if wall else 'cpu'}, device {args.device} {args.dtype}")
    bench_demo_step(20)
    small_dir = build_model(hidden=128, layers=2, heads=4, kv_heads=2)
    small = bench_generate(small_dir, args.repeats, label=" [0.3M params, the demo's shape]")
    a = bench_generate(model_dir, args.repeats, label=f" [{n_params / 1e6:.1f}M params]")
    print(f"generate ratio: {small:.2f} on the demo-sized model, {a:.2f} on the {n_params / 1e6:.1f}M one "
          "(the last line reports the larger model)")
    b = bench_mixed(model_dir, max(1, args.repeats - 1))
    c = bench_sync(args.repeats)
    print(f"generate_ratio={a:.2f} mixed_ratio={b:.2f} sync_ratio={c:.2f}")


if __name__ == "__main__":
    main()
