"""TorchSampler decode throughput on a hybrid model (Qwen3.5: Gated DeltaNet linear-attention
layers beside full attention) against transformers `generate` on the same model, in one run.

A tiny random Qwen3.5 (`ember tiny-model --family qwen3_5`'s layout: three linear layers,
then one full-attention layer; hidden 256, heads of 32). 32 prompts of 8-32 tokens x 64 new
tokens, sampling at temperature 1, no early stop, both sides returning per-token logprobs:
TorchSampler (64 slots, so that one owner's cap of all but 1/16 of them,
`scheduler.owner_slot_cap`, admits all 32 at once; each slot keeps the linear layers' recurrent state beside the KV,
`ember.sampling.kv_cache.RecurrentSlotLayer`) vs `generate(do_sample=True, output_logits=True)`
(left-padded batch, transformers' own cache; logprobs = log_softmax(logits) at the chosen
tokens). Both run transformers' reference PyTorch kernels of the delta rule and the
convolution (no flash-linear-attention, no causal_conv1d on CPU). Calls interleaved, the
median of `--repeats`, process CPU time with 1 torch thread (`--threads`; `--clock wall`
for wall time), as `benchmarks/sampling.py` measures.

Last line: `hybrid_vs_generate=<ratio>` (sampler tokens/s / generate tokens/s).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import torch
from _common import left_padded  # (also sets the offline environment, tests/ on sys.path)
from tinker import types

from ember.models import load_model
from ember.models.testing import build_tiny_model
from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler

PROMPTS, NEW_TOKENS = 32, 64


def _model_dir() -> str:
    out = tempfile.mkdtemp(prefix="ember-bench-hybrid-")
    build_tiny_model(out, family="qwen3_5", seed=0, tokenizer="bytes", hidden_size=256, num_layers=4, num_heads=8,
                     num_kv_heads=8, head_dim=32, max_position_embeddings=4096)
    return out


def _generate(model, prompts: list[list[int]], pad_id: int) -> int:
    ids, mask = left_padded(prompts, pad_id)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=pad_id)
        new = out.sequences[:, ids.shape[1]:]
        logprobs = torch.log_softmax(torch.stack(out.logits, dim=1).float(), -1).gather(2, new[..., None])
    assert logprobs.shape[:2] == new.shape == (len(prompts), NEW_TOKENS)
    return new.numel()


def _sample(sampler: TorchSampler, prompts: list[list[int]]) -> int:
    requests = [SamplingRequest(prompt=types.ModelInput.from_ints(p), num_samples=1,
                                sampling_params=types.SamplingParams(max_tokens=NEW_TOKENS, seed=i, stop=[]))
                for i, p in enumerate(prompts)]
    tokens = 0
    for response in sampler.sample_many(requests):
        if isinstance(response, Exception):
            raise response
        tokens += sum(len(s.tokens) for s in response.sequences)
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    model_dir = _model_dir()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(6, 200, size=int(rng.integers(8, 33))).tolist() for _ in range(PROMPTS)]
    model = load_model(model_dir).eval()
    pad_id = int(model.config.pad_token_id)
    sampler = TorchSampler.from_pretrained(model_dir, SamplerConfig(max_slots=2 * PROMPTS, max_len=256))
    _sample(sampler, prompts[:4]), _generate(model, prompts[:4], pad_id)  # warm-up
    ours, theirs = [], []
    for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
        t0 = clock()
        n_ours = _sample(sampler, prompts)
        t1 = clock()
        n_theirs = _generate(model, prompts, pad_id)
        t2 = clock()
        ours.append(t1 - t0)
        theirs.append(t2 - t1)
    sampler.close()
    assert n_ours == n_theirs == PROMPTS * NEW_TOKENS
    a, b = n_ours / float(np.median(ours)), n_theirs / float(np.median(theirs))
    print(f"tiny Qwen3.5 (hidden 256, 4 layers: 3 Gated DeltaNet + 1 attention), {PROMPTS} prompts x {NEW_TOKENS} "
          f"tokens, {args.clock} time, {args.threads} torch thread(s): TorchSampler {a:,.0f} tok/s, "
          f"HF generate {b:,.0f} tok/s")
    print(f"hybrid_vs_generate={a / b:.2f}")


if __name__ == "__main__":
    main()
