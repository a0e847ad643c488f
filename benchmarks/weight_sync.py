"""Weight sync trainer -> one sampler replica in another process: memory vs files.

The model is Qwen3-0.6B-shaped (hidden 1024, 28 layers, 16 heads / 8 KV heads of 128,
MLP 3072, vocabulary 151936, tied embeddings; ~0.6 B parameters, 2.4 GB in fp32) with
random weights from a transformers config; `--layers` shrinks it for a quick look. The
replica is a `TorchSampler` over the same config in a spawned process.

* memory: `WeightSender.send` over a standalone gloo group on 127.0.0.1 (256 MiB buckets)
  into `WeightReceiver.receive_into(sampler)` (ember.sampling.transport);
* files: today's path: the trainer writes the weights as `save_weights_for_sampler` does
  (`save_pretrained` safetensors, then fsync as the checkpoint store does), the replica
  reads them (`read_sampler_weights`) and `load_weights` them.

Each time is wall clock from the trainer starting the sync to the replica holding the new
version (the rendezvous is done once beforehand, as a pool does when a replica joins).
Modes are interleaved, `--repeats` each; medians. Last line:
`memory_s=<a> files_s=<b> memory_vs_files=<b/a>`.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

import torch

import _common  # noqa: F401 - sets the offline environment

QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096)


def qwen3_config(layers: int):
    from transformers import Qwen3Config

    return Qwen3Config(**{**QWEN3_06B, "num_hidden_layers": layers})


def empty_model(config):
    """The model with uninitialised weights (allocation only: HF's random init of 0.6 B
    parameters would take minutes on this CPU and is not what is measured)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives every parameter its own storage; Qwen3-0.6B ties lm_head
    return model


def replica(conn, address, layers: int) -> None:
    from ember.sampling import SamplerConfig, TorchSampler
    from ember.sampling.transport import WeightReceiver
    from ember.service.checkpoint_files import read_sampler_weights

    torch.set_num_threads(1)
    sampler = TorchSampler(empty_model(qwen3_config(layers)), None,
                           SamplerConfig(device="cpu", dtype="float32", max_len=64, max_slots=1, prefix_cache_tokens=0))
    receiver = WeightReceiver(address)
    conn.send("ready")
    version = None
    while (cmd := conn.recv()) is not None:
        version = None
        gc.collect()  # the previous version's memory goes before the next arrives
        if cmd == "memory":
            _, version = receiver.receive_into(sampler)
        else:
            version = sampler.load_weights(read_sampler_weights(Path(cmd)).items())
        conn.send(version.version_id)
    sampler.close()


def sync_memory(sender, conn, named) -> float:
    start = time.perf_counter()
    conn.send("memory")
    report = sender.send(named)
    assert report.delivered == ["replica"], report
    conn.recv()
    return time.perf_counter() - start


def sync_files(model, conn, named, scratch: Path, i: int) -> float:
    from ember.service.checkpoint_files import fsync_tree

    start = time.perf_counter()
    out = scratch / f"v{i}"
    model.save_pretrained(out, state_dict=dict(named), safe_serialization=True)
    fsync_tree(out)
    conn.send(str(out))
    conn.recv()
    seconds = time.perf_counter() - start
    for f in out.iterdir():
        f.unlink()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=QWEN3_06B["num_hidden_layers"])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from ember.sampling.transport import WeightSender, distinct_tensors

    torch.manual_seed(0)
    model = empty_model(qwen3_config(args.layers))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    named = list(model.state_dict().items())
    nbytes = sum(t.numel() * t.element_size() for _, t in distinct_tensors(named))
    print(f"model: {args.layers} layers, {nbytes / 1e9:.2f} GB fp32", flush=True)
    sender = WeightSender(timeout_s=600)
    address = sender.open("replica")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=replica, args=(child, address, args.layers), daemon=True)
    proc.start()
    assert parent.recv() == "ready" and sender.wait_joined("replica", 600)
    times: dict[str, list[float]] = {"memory": [], "files": []}
    with tempfile.TemporaryDirectory(prefix="ember-bench-wsync-") as scratch:
        for i in range(args.repeats):
            times["memory"].append(sync_memory(sender, parent, named))
            times["files"].append(sync_files(model, parent, named, Path(scratch), i))
            print(f"round {i}: memory {times['memory'][-1]:.2f} s, files {times['files'][-1]:.2f} s", flush=True)
    parent.send(None)
    proc.join(60)
    memory_s, files_s = statistics.median(times["memory"]), statistics.median(times["files"])
    print(f"memory_s={memory_s:.3f} files_s={files_s:.3f} memory_vs_files={files_s / memory_s:.2f}")


if __name__ == "__main__":
    main()
