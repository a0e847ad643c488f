"""Each FSDP rank sends its own shard (ember.sampling.weight_sync: `rank_part`,
`ShardReceiver`; `GroupEngine.open_shard_sync` / `send_weight_shards`): a world-2 worker
group (process ranks, gloo, FSDP2) sends a trained version, full and LoRA, to a sampler
replica process (`LocalReplica`, TorchSampler, fp32 CPU) with nothing gathered. Each rank
sends part of the weights (their sum is the whole); the replica's samples equal the
trainer's `forward` within 1e-4 (contract 5) and differ from the untrained model's.
The pieces are tested without processes too: `rank_part` of plain tensors, `assemble_shards`,
and gloo channels from two senders in this process to one `ShardReceiver` (assembled; ranks
that disagree on the version are refused, naming both).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.engine.parallel import ParallelismConfig
from ember.sampling import SamplerConfig
from ember.sampling import weight_sync as ws
from ember.sampling.base import SamplingRequest
from ember.sampling.weight_sync import assemble_shards, distinct_tensors, rank_part
from helpers.datums import random_sft_datums, sft_datum

PROMPTS = [[5, 6, 7, 8, 9], [12, 13, 14]]
TOL = 1e-4
START_S = 300.0  # spawned processes import torch and transformers: slow on a loaded 2-core machine
CONFIG = EngineConfig(micro_batch_tokens=32)


def test_assemble_joins_dim0_parts_in_rank_order_and_plain_tensors_come_from_rank0():
    big, small, scalar = torch.randn(7, 3), torch.randn(1, 4), torch.tensor(2.5)
    chunks = [big.chunk(2, 0), (small, small[1:])]  # uneven, and a rank with no rows
    parts = [[("big", chunks[0][r]), ("small", chunks[1][r])] for r in range(2)]
    parts[0].append(("scalar", rank_part(scalar, 0)))
    assert rank_part(scalar, 1) is None  # a plain (replicated) tensor travels once
    got = dict(assemble_shards(parts))
    assert list(got) == ["big", "small", "scalar"]
    assert torch.equal(got["big"], big) and torch.equal(got["small"], small) and torch.equal(got["scalar"], scalar)


def through_channels(parts: list[list[tuple[str, torch.Tensor]]], versions: list[str]):
    """Each "rank" (a WeightSender of this process) sends its parts under its version over
    gloo to one ShardReceiver (threads stand in for processes): what the receiver got or raised."""
    senders = [ws.WeightSender("127.0.0.1", "gloo", 60.0) for _ in parts]
    addresses = [s.open("replica") for s in senders]
    receiver = ws.ShardReceiver(addresses)  # each sender's rendezvous runs on its own thread
    outcome: dict = {}

    def receive() -> None:
        try:
            outcome["got"] = receiver.receive()
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            outcome["error"] = exc

    threads = [threading.Thread(target=receive)] + [
        threading.Thread(target=s.send, args=(p, v)) for s, p, v in zip(senders, parts, versions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return outcome


def test_shards_over_gloo_channels_arrive_assembled():
    emb, norm = torch.randn(9, 4), torch.randn(4)
    rows = emb.chunk(2, 0)
    outcome = through_channels([[("emb", rows[0]), ("norm", norm)], [("emb", rows[1])]], ["5", "5"])
    header, named = outcome["got"]
    assert header.version == "5" and header.lora_rank is None
    got = dict(named)
    assert torch.equal(got["emb"], emb) and torch.equal(got["norm"], norm)


def test_ranks_that_disagree_on_the_version_are_refused():
    t = torch.randn(4, 2)
    outcome = through_channels([[("w", t[:2])], [("w", t[2:])]], ["5", "6"])
    assert isinstance(outcome.get("error"), ws.WeightSyncError), outcome
    assert "rank 1 sent version '6'" in str(outcome["error"]) and "rank 0 version '5'" in str(outcome["error"])


@pytest.fixture(scope="module")
def group():
    from ember.workers import WorkerGroup

    g = WorkerGroup.create("process", world_size=2, call_timeout_s=START_S)
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def replica(tiny_model_dir):
    from ember.sampling.local_replica import LocalReplica

    r = LocalReplica.start(0, str(tiny_model_dir), SamplerConfig(max_slots=8, device="cpu", dtype="float32"), None)
    try:
        r.call("info").result(START_S)
        yield r
    finally:
        r.close()


def worst_vs_forward(forward, responses) -> float:
    datums, cuts, sampled = [], [], []
    for tokens, response in responses:
        for seq in response.sequences:
            datums.append(sft_datum(tokens + list(seq.tokens)))
            cuts.append(len(tokens) - 1)
            sampled.append(np.asarray(seq.logprobs))
    outs = forward(datums, "cross_entropy").loss_fn_outputs
    return max(float(np.abs(o["logprobs"].to_numpy()[c:] - s).max()) for o, c, s in zip(outs, cuts, sampled))


def sample(replica, key: int):
    out = []
    for i, tokens in enumerate(PROMPTS):
        params = types.SamplingParams(max_tokens=6, seed=7 + i, stop=[])
        req = SamplingRequest(prompt=types.ModelInput.from_ints(tokens), num_samples=2, sampling_params=params)
        out.append((tokens, replica.call("sample", req, key).result(START_S)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_each_fsdp_rank_sends_its_shard_and_the_replica_samples_like_the_trainer(lora, group, replica,
                                                                                 tiny_model_dir):
    from ember.workers import EngineSpec, GroupEngine

    lora_config = types.LoraConfig(rank=4, seed=3) if lora else None
    name = "lora" if lora else "full"
    eng = GroupEngine.create(group, name, EngineSpec(str(tiny_model_dir), CONFIG, ParallelismConfig(dp_shard=2),
                                                     lora_config=lora_config))
    eng.forward_backward(random_sft_datums(4, 84, seed=1), "cross_entropy")
    eng.optim_step(types.AdamParams(learning_rate=2e-2))

    addresses = eng.open_shard_sync(f"replica-{name}")
    assert len(addresses) == 2 and addresses[0].port != addresses[1].port  # one channel per rank
    replica.call("join_shard_sync", addresses).result(START_S)
    key = 11 if lora else 10
    received = replica.call("receive_shards")
    reports = eng.send_weight_shards(str(key), 4 if lora else None)
    assert received.result(START_S) == key
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["delivered"] == [f"replica-{name}"] and r["dropped"] == {} for r in reports), reports

    full_numel = sum(t.numel() for _, t in distinct_tensors(eng.named_weights()))
    assert all(0 < r["numel"] < full_numel for r in reports), reports  # shards, not the gathered version
    assert sum(r["numel"] for r in reports) == full_numel

    responses = sample(replica, key)
    assert worst_vs_forward(eng.forward, responses) < TOL
    untrained = TorchEngine.from_pretrained(tiny_model_dir, CONFIG, lora_config=lora_config)
    assert worst_vs_forward(untrained.forward, responses) > 1e-3  # the trained weights arrived
