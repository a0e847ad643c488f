"""Weights in memory (ember.sampling.transport): a trainer in this process, a sampler
replica in a spawned process, joined by a standalone gloo group.

Tensors arrive bitwise equal; a header that does not fit the replica's model is refused
before any data moves, naming the tensor; a replica that stops answering or dies is
dropped and reported without hanging the sender; sampling after a memory sync gives the
trainer's forward logprobs (contract 5, fp32, 1e-4), full and LoRA. The pieces are pure
functions too (bucket plan, pack/unpack, header parsing), tested here without processes.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal

import numpy as np
import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.sampling import transport as ws
from helpers.datums import random_sft_datums, sft_datum
from helpers.server import wait_until

PROMPTS = [[5, 6, 7, 8, 9], [12, 13, 14]]
TIMEOUT_S = 180.0  # a spawned replica imports torch and transformers: slow on a loaded 2-core machine


# ---------------------------------------------------------------------- the replica process
def _replica(conn, model_dir: str) -> None:
    """Command loop of the replica: a TorchSampler that receives versions over its channels."""
    from ember.sampling import SamplerConfig, TorchSampler

    torch.set_num_threads(1)
    sampler = TorchSampler.from_pretrained(model_dir, SamplerConfig(max_slots=8, device="cpu", dtype="float32"))
    channels, versions = [], {}
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        op, *args = cmd
        try:
            conn.send(("ok", _REPLICA_OPS[op](sampler, channels, versions, *args)))
        except Exception as exc:  # noqa: BLE001 - returned to the test, which asserts on it
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _join(sampler, channels, versions, address):
    channels.append(ws.WeightReceiver(address))
    return len(channels) - 1


def _raw(sampler, channels, versions, index):
    header, named = channels[index].receive()
    return header.version, {n: t.clone() for n, t in named}


def _into(sampler, channels, versions, index):
    key, version = channels[index].receive_into(sampler)
    versions[key] = version
    return key, version.is_lora


def _sample(sampler, channels, versions, key, prompts):
    version = versions[key]
    out = []
    for i, p in enumerate(prompts):
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7 + i, stop=[])
        resp = sampler.sample(types.ModelInput.from_ints(p), 2, params, version=version, timeout=120)
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(p), version=version)[1:]
        out.append(([(s.tokens, list(s.logprobs)) for s in resp.sequences], scored))
    return out


_REPLICA_OPS = {"join": _join, "raw": _raw, "into": _into, "sample": _sample}


class Replica:
    def __init__(self, model_dir) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_replica, args=(child, str(model_dir)), daemon=True)
        self.proc.start()
        assert self.conn.poll(TIMEOUT_S) and self.conn.recv() == "ready"

    def start(self, *cmd) -> None:
        self.conn.send(cmd)

    def reply(self):
        assert self.conn.poll(TIMEOUT_S), "the replica did not answer"
        return self.conn.recv()

    def call(self, *cmd):
        self.start(*cmd)
        status, value = self.reply()
        assert status == "ok", value
        return value

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture(scope="module")
def replica(tiny_model_dir):
    r = Replica(tiny_model_dir)
    yield r
    r.close()


@pytest.fixture(scope="module")
def sender(replica):
    s = ws.WeightSender(timeout_s=TIMEOUT_S, bucket_bytes=4096)  # small buckets: several per sync
    address = s.open("replica")
    assert replica.call("join", address) == 0
    assert s.wait_joined("replica", TIMEOUT_S)
    yield s
    s.close()


def _send(sender, replica, op, named, version, lora_rank=None):
    """Start the replica's receive, send, and return (sender's report or error, replica's reply)."""
    replica.start(op, 0)
    try:
        outcome = sender.send(named, version, lora_rank)
    except ws.WeightSyncRefused as exc:
        outcome = exc
    return outcome, replica.reply()


# ---------------------------------------------------------------------- pure pieces
def test_bucket_plan_keeps_order_bounds_buckets_and_sends_big_tensors_alone():
    sizes = [10, 20, 5000, 30, 30, 0, 40, 2 << 20, 7]
    specs = [ws.TensorSpec(f"t{i}", (n,), "uint8") for i, n in enumerate(sizes)]
    plan = ws.bucket_plan(specs, bucket_bytes=64)
    assert [i for b in plan for i in b] == list(range(len(sizes)))
    for bucket in plan:
        total = sum(sizes[i] for i in bucket)
        assert total <= 64 or len(bucket) == 1, (bucket, total)
    assert [2] in plan and [7] in plan  # over the bucket size, and over the 1 MiB "alone" size


def test_pack_unpack_round_trip_is_bitwise():
    tensors = [torch.randn(3, 5), torch.arange(4), torch.randn(7).to(torch.bfloat16), torch.empty(0, 3),
               torch.randn(4, 6)[:, ::2]]  # a non-contiguous one
    specs = [ws.spec_of(f"t{i}", t) for i, t in enumerate(tensors)]
    out = ws.unpack(ws.pack(tensors), specs)
    for a, b in zip(tensors, out):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("raw, field", [
    (b"not json", "malformed header"),
    (b'{"version": "1", "lora_rank": null, "bucket_bytes": 1, "tensors": [{"name": "w", "shape": [2], '
     b'"dtype": "complex128"}]}', "dtype must be one of"),
    (b'{"version": "1", "lora_rank": null, "bucket_bytes": 1, "tensors": [{"name": "w", "shape": [-1], '
     b'"dtype": "float32"}]}', "shape must be a list of ints >= 0"),
    (b'{"version": "1", "lora_rank": 0, "bucket_bytes": 1, "tensors": []}', "lora_rank"),
    (b'{"version": "1", "lora_rank": null, "bucket_bytes": 0, "tensors": []}', "bucket_bytes"),
])
def test_a_malformed_header_is_refused_naming_the_field(raw, field):
    with pytest.raises(ws.WeightSyncError, match=field):
        ws.SyncHeader.from_bytes(raw)


def test_tied_aliases_travel_once():
    w = torch.randn(4, 4)
    named = [("embed.weight", w), ("lm_head.weight", w), ("other", torch.randn(2))]
    assert [n for n, _ in ws.distinct_tensors(named)] == ["embed.weight", "other"]


def test_a_kept_version_is_a_copy_unless_the_caller_hands_it_over():
    """A pool's memory mode keeps each version's tensors for replacement replicas: with
    `copy=True` (Sampler.load_weights' default) a later write to the caller's live
    parameters must not change the kept version; `copy=False` keeps the caller's memory."""
    keeper = ws.ReplicaSync("127.0.0.1", timeout_s=5.0)
    try:
        live = {"w": torch.ones(4), "b": torch.zeros(2)}
        assert keeper.keep(1, live.items(), None) == 4 * 4 + 2 * 4
        keeper.keep(2, live.items(), None, copy=False)
        live["w"].add_(1.0)
        state = json.loads(json.dumps(keeper.debug_state()))  # JSON-safe
        kept = state["versions"]
        assert kept["1"]["w"]["sum"] == 4.0 and kept["1"]["w"]["data_ptr"] != live["w"].data_ptr()  # a copy of ones
        assert kept["2"]["w"]["data_ptr"] == live["w"].data_ptr() and kept["2"]["w"]["sum"] == 8.0  # the live tensor
    finally:
        keeper.close()


# ---------------------------------------------------------------------- two processes
@pytest.mark.slow  # a spawned replica process (torch + transformers import, gloo group): the pure pieces above stay in test-fast
def test_tensors_arrive_bitwise_equal(sender, replica):
    named = [("a", torch.randn(10, 20)), ("b", torch.arange(7)), ("c", torch.randn(300).to(torch.bfloat16)),
             ("d", torch.empty(0)), ("e", torch.randn(3000)), ("f", torch.tensor([True, False]))]
    report, (status, value) = _send(sender, replica, "raw", named, "raw-1")
    assert status == "ok", value
    assert report.delivered == ["replica"] and not report.dropped
    version, got = value
    assert version == "raw-1" and list(got) == [n for n, _ in named]
    for name, t in named:
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


@pytest.mark.slow  # a spawned replica process (torch + transformers import, gloo group): the pure pieces above stay in test-fast
@pytest.mark.parametrize("change, match", [
    ("shape", "model.layers.1.mlp.down_proj.weight.*expected shape"),
    ("name", "unknown weight name 'model.layers.9.mlp.down_proj.weight'"),
    ("missing", "missing 1"),
])
def test_a_mismatched_version_is_refused_naming_the_tensor(change, match, tiny_model_dir, sender, replica):
    named = list(TorchEngine.from_pretrained(tiny_model_dir, EngineConfig()).named_weights())
    i = next(k for k, (n, _) in enumerate(named) if n == "model.layers.1.mlp.down_proj.weight")
    name, t = named[i]
    if change == "shape":
        named[i] = (name, t.t().contiguous())
    elif change == "name":
        named[i] = ("model.layers.9.mlp.down_proj.weight", t)
    else:
        del named[i]
    refused, (status, value) = _send(sender, replica, "into", named, f"bad-{change}")
    assert isinstance(refused, ws.WeightSyncRefused) and refused.args[0], refused
    assert status == "error" and "WeightSyncRefused" in value
    import re
    assert re.search(match, str(refused)) and re.search(match, value), (str(refused), value)
    assert sender.receivers == ["replica"]  # a refusal is not a failure: the channel stays


@pytest.mark.slow  # a spawned replica process (torch + transformers import, gloo group): the pure pieces above stay in test-fast
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sampling_after_a_memory_sync_matches_the_trainers_forward(lora, tiny_model_dir, sender, replica):
    lora_config = types.LoraConfig(rank=4, seed=3) if lora else None
    engine = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(), lora_config=lora_config)
    for k in range(2):
        engine.forward_backward(random_sft_datums(4, 84, seed=k), "cross_entropy")
        engine.optim_step(types.AdamParams(learning_rate=2e-2))
    key = f"trained-{'lora' if lora else 'full'}"
    report, (status, value) = _send(sender, replica, "into", engine.named_weights(), key, 4 if lora else None)
    assert status == "ok", value
    assert value == (key, lora) and report.delivered == ["replica"]
    sampled = replica.call("sample", key, PROMPTS)
    datums, cuts, expected = [], [], []
    for p, (sequences, _) in zip(PROMPTS, sampled):
        for tokens, logprobs in sequences:
            datums.append(sft_datum(p + tokens))
            cuts.append(len(p) - 1)
            expected.append(np.asarray(logprobs))
    worst = 0.0
    for out, cut, want in zip(engine.forward(datums, "cross_entropy").loss_fn_outputs, cuts, expected):
        worst = max(worst, float(np.abs(out["logprobs"].to_numpy()[cut:] - want).max()))
    prompt_out = engine.forward([sft_datum(p) for p in PROMPTS], "cross_entropy").loss_fn_outputs
    for out, (_, scored) in zip(prompt_out, sampled):
        worst = max(worst, float(np.abs(out["logprobs"].to_numpy() - np.asarray(scored, np.float32)).max()))
    assert worst < 1e-4, worst
    base = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig())
    untrained = base.forward([sft_datum(PROMPTS[0])], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.abs(untrained - np.asarray(sampled[0][1], np.float32)).max() > 1e-3  # the sync changed the model


@pytest.mark.slow  # a spawned replica process (torch + transformers import, gloo group): the pure pieces above stay in test-fast
def test_an_unresponsive_receiver_is_dropped_and_the_others_still_get_the_version(sender, replica):
    """The replica joins a second channel but never receives on it: the send to it times out
    (5 s), it is dropped and reported, and the live channel delivered."""
    quick = ws.WeightSender(timeout_s=5.0)
    try:
        replica.call("join", quick.open("silent"))
        assert quick.wait_joined("silent", TIMEOUT_S)
        report = quick.send([("w", torch.randn(8))], "to-nobody")
        assert report.delivered == [] and "silent" in report.dropped and quick.receivers == []
    finally:
        quick.close()
    report, (status, _) = _send(sender, replica, "raw", [("w", torch.ones(3))], "still-alive")
    assert status == "ok" and report.delivered == ["replica"]


@pytest.mark.slow  # a spawned replica process (torch + transformers import, gloo group): the pure pieces above stay in test-fast
def test_a_dead_receiver_is_dropped_without_hanging_the_sender(sender, replica):
    """Last in this file: it kills the module's replica."""
    os.kill(replica.proc.pid, signal.SIGKILL)
    replica.proc.join(30)
    report = sender.send([("w", torch.randn(1000))], "to-the-dead")
    assert report.delivered == [] and "replica" in report.dropped, report
    assert sender.receivers == []


# ---------------------------------------------------------------------- a pool in memory mode
def _matches_forward(engine, prompts_and_responses) -> float:
    datums, cuts, expected = [], [], []
    for p, resp in prompts_and_responses:
        for seq in resp.sequences:
            datums.append(sft_datum(p + seq.tokens))
            cuts.append(len(p) - 1)
            expected.append(np.asarray(seq.logprobs))
    outs = engine.forward(datums, "cross_entropy").loss_fn_outputs
    return max(float(np.abs(o["logprobs"].to_numpy()[c:] - w).max()) for o, c, w in zip(outs, cuts, expected))


def _pool_round(pool, version, sessions):
    from ember.sampling import SamplingRequest

    requests = [SamplingRequest(prompt=types.ModelInput.from_ints(PROMPTS[i % 2]), num_samples=1, version=version,
                                sampling_params=types.SamplingParams(max_tokens=5, seed=i, stop=[]), session=s)
                for i, s in enumerate(sessions)]
    return [(PROMPTS[i % 2], f.result(TIMEOUT_S)) for i, f in enumerate(pool.submit_many(requests))]


@pytest.mark.slow
def test_a_pool_in_memory_mode_writes_no_file_and_a_replacement_gets_the_live_versions(tiny_model_dir, tmp_path):
    """SamplerPool with weight_sync="memory": the version reaches both replicas over their
    channels (no file under the pool's scratch directory), samples from each replica match
    the trainer's forward (1e-4), and after a replica is killed its replacement is synced
    the live version in memory and serves it."""
    from ember.sampling import SamplerConfig
    from ember.sampling.pool import SamplerPool

    engine = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig())
    engine.forward_backward(random_sft_datums(4, 84, seed=1), "cross_entropy")
    engine.optim_step(types.AdamParams(learning_rate=2e-2))
    cfg = SamplerConfig(replicas=2, weight_sync="memory", device="cpu", dtype="float32", max_slots=8,
                        replica_timeout_s=60.0)
    pool = SamplerPool(tiny_model_dir, cfg, scratch_dir=tmp_path)
    try:
        version = pool.load_weights(engine.named_weights())
        assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
        kept = sum(t.numel() * t.element_size() for _, t in ws.distinct_tensors(engine.named_weights()))
        assert version.nbytes() == kept > 0  # what the pool holds for replacements (no file to measure)
        sessions = [f"session-{i}" for i in range(12)]
        assert _matches_forward(engine, _pool_round(pool, version, sessions)) < 1e-4
        assert all(s["requests_total"] > 0 for s in pool.replica_stats())  # both replicas served
        os.kill(pool.replica_pids()[0], signal.SIGKILL)
        wait_until(lambda: pool.replica_stats()[0]["restarts"] == 1 and pool.replica_stats()[0]["up"],
                   2 * TIMEOUT_S, interval=0.5, message="the killed replica replaced")
        before = pool.replica_stats()[0]["requests_total"]
        assert _matches_forward(engine, _pool_round(pool, version, sessions)) < 1e-4
        assert pool.replica_stats()[0]["requests_total"] > before  # the replacement served the version
        assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
    finally:
        pool.close()


# ---------------------------------------------------------------------- vLLM's own weight-transfer API
@pytest.mark.slow
def test_vllm_cpu_receives_weights_in_memory_through_its_weight_transfer_engine(tiny_vllm_model_dir, monkeypatch):
    """vLLM (CPU) started with `weight_transfer_config=ember_gloo` (registered in its engine
    core through `worker_extension_cls`) joins a channel with `init_weight_transfer_engine`
    and takes a trained engine's weights with `start_weight_update` / `update_weights` /
    `finish_weight_update`; its logprob of the next token then equals the trainer's forward
    (1e-4) and differs from the base model's."""
    import asyncio
    import threading

    from ember.sampling.registry import backend_missing

    if backend_missing("vllm"):
        pytest.skip(reason=backend_missing("vllm"))
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
    from vllm.v1.engine.async_llm import AsyncLLM

    from ember.sampling import SamplerConfig
    from ember.sampling.vllm_sampler import CPU_ENGINE_EXIT_GRACE_S, engine_kwargs
    from ember.sampling.vllm_weight_engine import ENGINE_NAME, WORKER_EXTENSION

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    # engine_kwargs asks for the model in the engine core (SamplerConfig.cpu_worker "inline"),
    # which vLLM's CPU platform grants while this is "0" (VLLMSampler sets it the same way)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine = TorchEngine.from_pretrained(tiny_vllm_model_dir, EngineConfig())
    engine.forward_backward(random_sft_datums(4, 84, seed=2), "cross_entropy")
    engine.optim_step(types.AdamParams(learning_rate=5e-2))
    prompt = PROMPTS[0]
    kwargs = engine_kwargs(tiny_vllm_model_dir, SamplerConfig(backend="vllm", device="cpu", dtype="float32",
                                                              max_slots=4), 128)
    args = AsyncEngineArgs(**kwargs, gpu_memory_utilization=0.2, worker_extension_cls=WORKER_EXTENSION,
                           weight_transfer_config=WeightTransferConfig(backend=ENGINE_NAME))

    async def next_token_logprob(llm, tag):
        params = SamplingParams(max_tokens=1, logprobs=0, temperature=1.0, seed=1)
        async for out in llm.generate({"prompt_token_ids": prompt}, params, request_id=tag):
            final = out
        token, = final.outputs[0].logprobs[0]
        return token, final.outputs[0].logprobs[0][token].logprob

    async def run():
        llm = AsyncLLM.from_engine_args(args)
        sender = ws.WeightSender(timeout_s=TIMEOUT_S)
        try:
            address = sender.open("vllm")
            init = dict(host=address.host, port=address.port, timeout_s=TIMEOUT_S)
            await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init))
            base = await next_token_logprob(llm, "base")
            await llm.start_weight_update()
            reports = []
            push = threading.Thread(target=lambda: reports.append(sender.send(engine.named_weights(), "v1")))
            push.start()
            await llm.update_weights(WeightTransferUpdateRequest(update_info={"version": "v1"}))
            await llm.finish_weight_update()
            push.join(TIMEOUT_S)
            await llm.reset_prefix_cache()
            return base, await next_token_logprob(llm, "synced"), reports
        finally:
            llm.shutdown(timeout=CPU_ENGINE_EXIT_GRACE_S)  # as VLLMSampler closes a CPU engine

    (base_token, base_lp), (token, logprob), reports = asyncio.run(run())
    assert reports and reports[0].delivered == ["vllm"], reports
    want = engine.forward([sft_datum(prompt + [token])], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_numpy()[-1]
    assert abs(logprob - float(want)) < 1e-4, (logprob, float(want))
    base = TorchEngine.from_pretrained(tiny_vllm_model_dir, EngineConfig())
    untrained = base.forward([sft_datum(prompt + [token])], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_numpy()
    assert abs(float(untrained[-1]) - float(want)) > 1e-3  # the trained weights differ: the check is not vacuous


# ---------------------------------------------------------------------- CUDA (GPU-marked)
def _nccl_receiver(address, conn) -> None:
    """The replica's way: the channel joined and used on a thread (current device 0), on cuda:1."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as op_thread:
        named = op_thread.submit(lambda: ws.receive_version(ws.join_channel(address, "cuda:1"))[1]).result()
    conn.send([(n, t.device.index, t.cpu()) for n, t in named])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: this machine has fewer than 2")
def test_nccl_channel_moves_tensors_between_gpus():
    """Both ends on threads of their own (as `WeightSender` and a replica's op thread), each
    on the device it was given: the sender's cuda:0, the receiver's cuda:1."""
    sender = ws.WeightSender(backend="nccl", timeout_s=TIMEOUT_S, device="cuda:0")
    address = sender.open("r")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_nccl_receiver, args=(address, child), daemon=True)
    proc.start()
    named = [("w", torch.randn(1000, 100, device="cuda:0")), ("n", torch.randn(7, device="cuda:0"))]
    report = sender.send(named, "1")
    assert report.delivered == ["r"], report.dropped
    assert parent.poll(TIMEOUT_S)
    got = {n: (index, t) for n, index, t in parent.recv()}
    proc.join(30)
    for name, t in named:
        assert got[name][0] == 1 and torch.equal(got[name][1], t.cpu()), name


def _dead_nccl_receiver(address) -> None:
    ws.join_channel(address, "cuda:1")
    os._exit(0)  # joined, then gone without answering


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: this machine has fewer than 2")
def test_a_dead_nccl_receiver_only_drops_its_channel():
    """torch's NCCL watchdog ends the process on a timed-out collective by default; the
    weight-sync group is built to abort only its communicator, so the sender lives on."""
    sender = ws.WeightSender(backend="nccl", timeout_s=10.0, device="cuda:0")
    address = sender.open("gone")
    proc = mp.get_context("spawn").Process(target=_dead_nccl_receiver, args=(address,), daemon=True)
    proc.start()
    report = sender.send([("w", torch.randn(64, device="cuda:0"))], "1")
    proc.join(30)
    assert "gone" in report.dropped and sender.receivers == []
    assert torch.ones(1, device="cuda:0").item() == 1.0  # this process and its GPU still work


# ---------------------------------------------------------------------- devices (NCCL ends)
def test_an_nccl_channel_end_keeps_the_device_it_was_given_on_a_new_thread():
    """A channel is built and used on threads of its own, whose current CUDA device is 0
    whatever the process set: each end must hold the device it was given (a trainer on
    cuda:0 and a replica on cuda:2 must not both land on cuda:0, which NCCL refuses)."""
    import threading

    got = {}

    def build() -> None:  # as the join thread (`_Pending`) and the replica's op thread do
        got["end"] = ws.Channel(None, None, 1, "nccl", 1.0, device="cuda:2")

    t = threading.Thread(target=build)
    t.start()
    t.join()
    assert got["end"].device == torch.device("cuda", 2)
    assert ws.WeightSender(backend="nccl", device=torch.device("cuda", 3)).device == torch.device("cuda", 3)
    assert ws.channel_device("nccl", "cuda") == torch.device("cuda", 0)
    assert ws.channel_device("gloo", "cuda:1") == torch.device("cpu")  # gloo buffers live on the host


@pytest.mark.parametrize("make", [
    lambda: ws.WeightSender(backend="nccl"),
    lambda: ws.Channel(None, None, 0, "nccl", 1.0),
    lambda: ws.channel_device("nccl", "cpu"),
], ids=["sender", "channel", "cpu-device"])
def test_an_nccl_end_without_its_cuda_device_is_refused(make):
    with pytest.raises(ValueError, match="needs this end's CUDA device"):
        make()


@pytest.mark.parametrize("sender, receivers, backend", [
    ("cuda:0", ["cuda:1", "cuda:2"], "nccl"),  # the README's layout: a GPU each
    ("cuda:0", ["cuda:0", "cuda:1"], "gloo"),  # one replica on the trainer's GPU: NCCL refuses two ranks there
    ("cuda", ["cuda:0"], "gloo"),  # "cuda" is cuda:0
    ("cuda:1", ["cpu"], "gloo"),
    ("cpu", ["cuda:1"], "gloo"),
    (None, ["cuda:1"], "gloo"),
])
def test_sync_backend_is_nccl_only_between_distinct_gpus(sender, receivers, backend):
    assert ws.sync_backend(sender, receivers) == backend


def test_an_nccl_group_is_built_with_error_handling_that_keeps_the_process(monkeypatch):
    """A timed-out NCCL collective must only fail its channel: the group is built while
    TORCH_NCCL_ASYNC_ERROR_HANDLING is 2 (abort the communicator; torch's default ends the
    process); the caller's value is back afterwards."""
    import os

    name, value = ws.NCCL_ERROR_HANDLING
    assert (name, value) == ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    monkeypatch.setenv(name, "1")
    with ws.nccl_error_handling():
        assert os.environ[name] == "2"
    assert os.environ[name] == "1"
    monkeypatch.delenv(name)
    with ws.nccl_error_handling():
        assert os.environ[name] == "2"
    assert name not in os.environ


def test_a_replica_joins_its_channel_on_its_own_device(tiny_model_dir):
    """`ReplicaHost` hands its sampler's device to the receiver: on the CPU an NCCL channel is
    refused naming 'cpu' (the replica's device), before anything connects."""
    from ember.sampling import SamplerConfig
    from ember.sampling.replica import ReplicaHost

    host = ReplicaHost(str(tiny_model_dir), SamplerConfig(device="cpu", max_slots=2))
    try:
        with pytest.raises(ValueError, match="NCCL needs this end's CUDA device .*got 'cpu'"):
            host.join_weight_sync(ws.ChannelAddress("127.0.0.1", 1, "nccl", 1.0))
    finally:
        host.close()
