"""TorchEngine forward_backward + optim_step vs a hand-written PyTorch loop.

Same model (Qwen3, hidden 256, 4 layers), same data (16 sequences × 128 tokens, weighted
cross-entropy summed over tokens), same AdamW. Prints tokens/s of both and the ratio
engine/hand-written (target >= 0.95). Last line: `ratio=<x>`.
"""

from __future__ import annotations

import os

import torch
from _common import build_model, time_interleaved
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from helpers.datums import sft_datum
from ember.models import load_model

BATCH, SEQ = 16, 128
ADAM = types.AdamParams(learning_rate=1e-4)


def main() -> None:
    # One intra-op thread: on a shared 2-core machine, thread scheduling noise would swamp
    # the difference being measured (pass EMBER_BENCH_THREADS to change).
    torch.set_num_threads(int(os.environ.get("EMBER_BENCH_THREADS", "1")))
    torch.manual_seed(0)
    model_dir = build_model()
    tokens = torch.randint(0, 80, (BATCH, SEQ + 1))
    weights = torch.rand(BATCH, SEQ)
    datums = [sft_datum(tokens[i].tolist(), weights[i].tolist()) for i in range(BATCH)]

    engine = TorchEngine.from_pretrained(model_dir, EngineConfig(micro_batch_tokens=BATCH * SEQ))

    model = load_model(model_dir)
    model.eval()
    opt = torch.optim.AdamW(model.parameters(), lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2),
                            eps=ADAM.eps, weight_decay=ADAM.weight_decay)

    def hand_written() -> None:
        logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
        logp = torch.log_softmax(logits.float(), -1).gather(2, tokens[:, 1:].unsqueeze(2)).squeeze(2)
        (-(weights * logp).sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def ember_engine() -> None:
        engine.forward_backward(datums, "cross_entropy")
        engine.optim_step(ADAM)

    t = time_interleaved({"hand": hand_written, "ember": ember_engine}, repeats=10)
    n_tokens = BATCH * SEQ
    hand_tps, ember_tps = n_tokens / t["hand"], n_tokens / t["ember"]
    print(f"hand-written loop: {hand_tps:,.0f} tokens/s ({t['hand'] * 1e3:.1f} ms/step)")
    print(f"ember TorchEngine: {ember_tps:,.0f} tokens/s ({t['ember'] * 1e3:.1f} ms/step)")
    print(f"ratio={ember_tps / hand_tps:.3f}")


if __name__ == "__main__":
    main()
