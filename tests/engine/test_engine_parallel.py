"""Contract 2 across layouts: world 1 vs world 2 (FSDP2, replication, TP) on CPU gloo. Also
LoRA under FSDP2, activation checkpointing, resharding DCP checkpoints (save at world 2 → load
at world 1 and back) and `named_weights`; last, a rank killed with SIGKILL, then the group
rebuilt and resumed from its checkpoint.

Runtimes: every case runs on `process`. The runtime only carries pickled calls to the ranks
and the layout only shapes what the ranks compute, so `ray` runs one representative layout
(FSDP2: every call kind, collectives, `named_weights`, grad-norm) and the fault test (a dead
actor's detection and a rebuilt Ray group that loads a checkpoint are Ray's own code).

Tolerances (fp32): losses, logprobs, gradients and parameters after SGD steps agree with
world 1 to rtol 1e-5, with atol 1e-5 · the largest reference magnitude (of the tensor for
outputs, of the whole model for gradients/parameters) for entries near zero — a sum over
two ranks, or a row split over TP ranks, changes fp32 rounding. Parameters are compared after
SGD steps only: Adam's m/√v amplifies reduction-order noise in tiny-gradient entries.
"""

import contextlib
import dataclasses
import os
import signal
import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.engine.parallel import ParallelismConfig
from helpers.datums import random_rl_datums, random_sft_datums
from ember.workers import EngineSpec, GroupEngine, WorkerDiedError, WorkerError, WorkerGroup
from helpers import ranks as wt
from helpers.layouts import check_params_then_align, close, close_dicts, close_outputs
from helpers.server import wait_until

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

CONFIG = EngineConfig(micro_batch_tokens=16)  # several micro-batches per rank, unequal counts
TP_CONFIG = EngineConfig(micro_batch_tokens=64)  # DTensor ops are slow on CPU: fewer passes
LR = 1e-3  # a step of ~1% of the weights: large steps make the tiny model chaotic (noise amplified)
LAYOUTS = {
    "fsdp": ParallelismConfig(dp_shard=2),
    "replicate": ParallelismConfig(dp_replicate=2),
    "tp": ParallelismConfig(tp=2),
    "fsdp-ac": ParallelismConfig(dp_shard=2, activation_checkpointing=True),
}


@pytest.fixture(scope="module", params=["process", "ray"])
def group(request, ray_cluster):
    if request.param == "ray":
        ray_cluster.start()
    g = make_group(request.param)
    yield g
    g.shutdown()


def make_group(runtime: str) -> WorkerGroup:
    return WorkerGroup.create(runtime, world_size=2, call_timeout_s=300)  # `ray`: joins the worker's cluster


def batches():
    # odd sizes, a batch smaller than dp (one rank gets nothing), skewed lengths, an RL loss
    short = random_sft_datums(2, vocab=84, min_len=2, max_len=3, seed=3)
    long = random_sft_datums(1, vocab=84, min_len=30, max_len=30, seed=4)
    return [
        (random_sft_datums(5, vocab=84, min_len=2, max_len=14, seed=1), "cross_entropy"),
        (random_sft_datums(1, vocab=84, seed=2), "cross_entropy"),
        (short + long, "cross_entropy"),
        # a smooth RL loss: ppo's clip makes the gradient jump where a ratio sits on a bound
        (random_rl_datums(3, vocab=84, seed=5), "importance_sampling"),
    ]


def train_both(group, ref, eng, name):
    for datums, loss in batches():
        close_outputs(eng.forward_backward(datums, loss), ref.forward_backward(datums, loss))
        close_dicts(group.run(name, wt.full_grads), wt.full_grads(ref), f"{loss} grad")
        group.run(name, wt.sgd_step, LR)
        wt.sgd_step(ref, LR)


def config_for(layout: str) -> EngineConfig:
    return TP_CONFIG if layout.startswith("tp") else CONFIG


# One group per runtime for the whole module: a parametrization of `group` must name the
# runtime by itself (`PROCESS_ONLY`), so pytest sees the same parameter and reuses the group
# (a tuple of (runtime, layout) is a new parameter each, and a new group: 40 s under Ray).
# `ray` is left to the fixture's default parameters (both runtimes) only where the module
# docstring says; every other test runs on `process` alone. A parametrize that names `group`
# beside direct arguments needs scope="module", or pytest scopes it per test (a group each).
PROCESS_ONLY = pytest.mark.parametrize("group", ["process"], indirect=True)
LAYOUT_CASES = [("process", "fsdp"), ("process", "replicate"), ("process", "tp"), ("ray", "fsdp")]


@pytest.mark.parametrize(("group", "layout"), LAYOUT_CASES, indirect=["group"], scope="module",
                         ids=[f"{runtime}-{layout}" for runtime, layout in LAYOUT_CASES])
def test_world2_layout_matches_world1(group, tiny_model_dir, layout):
    check_layout_matches_world1(group, tiny_model_dir, layout)


@PROCESS_ONLY
def test_world2_activation_checkpointing_matches_world1(group, tiny_model_dir):
    """Activation checkpointing does not depend on the runtime: process only."""
    check_layout_matches_world1(group, tiny_model_dir, "fsdp-ac")


def check_layout_matches_world1(group, tiny_model_dir, layout):
    name = f"exact-{layout}"
    ref = TorchEngine.from_pretrained(tiny_model_dir, config_for(layout))
    eng = GroupEngine.create(group, name, EngineSpec(str(tiny_model_dir), config_for(layout), LAYOUTS[layout]))
    try:
        assert eng.info().parallel == LAYOUTS[layout].as_dict()
        train_both(group, ref, eng, name)
        close_dicts(dict(eng.named_weights()), dict(ref.named_weights()), "named_weights")
        check_params_then_align(ref, group.run(name, wt.full_params))
        datums = random_sft_datums(4, vocab=84, seed=9)
        close_outputs(eng.forward(datums, "cross_entropy"), ref.forward(datums, "cross_entropy"))
        # grad-norm and clipping are global (across shards), as in one process
        eng.forward_backward(datums, "cross_entropy"), ref.forward_backward(datums, "cross_entropy")
        adam = types.AdamParams(learning_rate=1e-3, grad_clip_norm=0.1)
        assert eng.optim_step(adam)["grad_norm:mean"] == pytest.approx(ref.optim_step(adam)["grad_norm:mean"], rel=1e-5)
        assert eng.status().step == 1
    finally:
        eng.close()


@PROCESS_ONLY
def test_tp_llama_matches_world1(group, tiny_llama_dir):
    ref = TorchEngine.from_pretrained(tiny_llama_dir, TP_CONFIG)
    eng = GroupEngine.create(group, "tp-llama", EngineSpec(str(tiny_llama_dir), TP_CONFIG, ParallelismConfig(tp=2)))
    try:
        train_both(group, ref, eng, "tp-llama")
        close_dicts(group.run("tp-llama", wt.full_params), wt.full_params(ref), "param after SGD")
    finally:
        eng.close()


@PROCESS_ONLY
@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_lora_gradients_reach_adapters_in_every_layer(group, tiny_model_dir, layout, tmp_path):
    lora = types.LoraConfig(rank=4)
    name = f"lora-{layout}"
    ref = TorchEngine.from_pretrained(tiny_model_dir, config_for(layout), lora_config=lora)
    eng = GroupEngine.create(group, name, EngineSpec(str(tiny_model_dir), config_for(layout), LAYOUTS[layout], lora))
    try:
        datums = random_sft_datums(5, vocab=84, seed=11)
        for _ in range(2):  # B starts at 0, so A's gradient is 0 until one step was taken
            close_outputs(eng.forward_backward(datums, "cross_entropy"), ref.forward_backward(datums, "cross_entropy"))
            grads = group.run(name, wt.full_grads)
            close_dicts(grads, wt.full_grads(ref), "lora grad")
            group.run(name, wt.sgd_step, LR), wt.sgd_step(ref, LR)
        layers = {int(n.split(".layers.")[1].split(".")[0]) for n in grads if ".layers." in n}
        assert layers == {0, 1}
        zero = [n for n, g in grads.items() if not g.abs().max() > 0]
        assert not zero, f"adapters without gradient: {zero}"
        assert all(".lora_" in n for n in grads)  # the base model stays frozen
        assert [n for n, _ in eng.named_weights()] == [n for n, _ in ref.named_weights()]
        eng.export_hf(tmp_path / "w2"), ref.export_hf(tmp_path / "w1")  # peft-loadable, gathered
        close_dicts(load_file(tmp_path / "w2" / "adapter_model.safetensors"),
                    load_file(tmp_path / "w1" / "adapter_model.safetensors"), "exported adapter")
    finally:
        eng.close()


# The chunked policy head (EngineConfig.logprob_chunk_tokens) at world 2 against the
# unchunked head at world 1: lm_head runs outside the root FSDP2 forward; under TP it is
# split by vocabulary rows (ember.engine.vocab_parallel; more in test_engine_parallel_vocab.py).
CHUNKED_CASES = [("fsdp", False), ("tp", False), ("fsdp-ac", False), ("fsdp", True), ("tp", True)]


@PROCESS_ONLY
@pytest.mark.parametrize(("layout", "lora"), CHUNKED_CASES,
                         ids=[f"{layout}-{'lora' if lora else 'full'}" for layout, lora in CHUNKED_CASES])
def test_world2_chunked_head_matches_world1_unchunked(group, tiny_model_dir, layout, lora):
    lora_config = types.LoraConfig(rank=4) if lora else None
    base = config_for(layout)
    name = f"chunked-{layout}-{lora}"
    ref = TorchEngine.from_pretrained(tiny_model_dir, dataclasses.replace(base, logprob_chunk_tokens=0),
                                      lora_config=lora_config)
    spec = EngineSpec(str(tiny_model_dir), dataclasses.replace(base, logprob_chunk_tokens=5), LAYOUTS[layout],
                      lora_config)
    eng = GroupEngine.create(group, name, spec)
    try:
        train_both(group, ref, eng, name)
        check_params_then_align(ref, group.run(name, wt.full_params))
        datums = random_sft_datums(4, vocab=84, seed=9)
        close_outputs(eng.forward(datums, "cross_entropy"), ref.forward(datums, "cross_entropy"))
    finally:
        eng.close()


@PROCESS_ONLY
def test_resharding_save_at_world2_load_at_world1_and_back(group, tiny_model_dir, tmp_path):
    adam = types.AdamParams(learning_rate=1e-2)
    spec = EngineSpec(str(tiny_model_dir), CONFIG, ParallelismConfig(dp_shard=2))
    first, nxt = random_sft_datums(5, vocab=84, seed=21), random_sft_datums(3, vocab=84, seed=22)
    eng = GroupEngine.create(group, "reshard-w2", spec)
    try:
        eng.forward_backward(first, "cross_entropy")
        eng.optim_step(adam)
        eng.save_state(tmp_path / "w2")
        saved = group.run("reshard-w2", wt.full_params)
        out2 = eng.forward_backward(nxt, "cross_entropy")
        grads2 = group.run("reshard-w2", wt.full_grads)
    finally:
        eng.close()
    w1 = TorchEngine.from_pretrained(tiny_model_dir, CONFIG)
    w1.load_state(tmp_path / "w2")
    assert w1.step == 1
    for n, p in wt.full_params(w1).items():
        assert torch.equal(p, saved[n]), n  # loading reshards exactly
    close_outputs(w1.forward_backward(nxt, "cross_entropy"), out2)
    close_dicts(wt.full_grads(w1), grads2, "grad after world-2 → world-1 load")
    w1.optim_step(adam)
    w1.save_state(tmp_path / "w1")
    back = GroupEngine.create(group, "reshard-back", spec)
    try:
        back.load_state(tmp_path / "w1")
        assert back.status().step == 2
        loaded = group.run("reshard-back", wt.full_params)
        for n, p in wt.full_params(w1).items():
            assert torch.equal(loaded[n], p), n
        close_outputs(back.forward_backward(first, "cross_entropy"), w1.forward_backward(first, "cross_entropy"))
        close_dicts(group.run("reshard-back", wt.full_grads), wt.full_grads(w1), "grad after world-1 → world-2 load")
    finally:
        back.close()


@PROCESS_ONLY
def test_dimuon_under_fsdp_matches_world1_and_reshards(group, tiny_model_dir, tmp_path):
    """Dimuon on dp_shard=2 (full matrices gathered for the matrix sign) = world 1; its momentum reshards."""
    dimuon, lora = types.DimuonParams(learning_rate=1e-2), types.LoraConfig(rank=4, seed=0)
    spec = EngineSpec(str(tiny_model_dir), CONFIG, ParallelismConfig(dp_shard=2), lora, optimizer="dimuon")
    ref = TorchEngine.from_pretrained(tiny_model_dir, CONFIG, lora, optimizer_config={"type": "dimuon"})
    eng = GroupEngine.create(group, "dimuon-w2", spec)
    try:
        for seed in (31, 32):
            datums = random_sft_datums(4, vocab=84, seed=seed)
            eng.forward_backward(datums, "cross_entropy")
            eng.optim_step(dimuon)
            ref.forward_backward(datums, "cross_entropy")
            ref.optim_step(dimuon)
        close_dicts(group.run("dimuon-w2", wt.full_params), wt.full_params(ref), "params after 2 Dimuon steps")
        eng.save_state(tmp_path / "w2")
        saved = group.run("dimuon-w2", wt.full_params)
    finally:
        eng.close()
    w1 = TorchEngine.from_pretrained(tiny_model_dir, CONFIG, lora, optimizer_config={"type": "dimuon"})
    w1.load_state(tmp_path / "w2")
    for n, p in wt.full_params(w1).items():
        assert torch.equal(p, saved[n]), n
    for p, q in zip(w1.state_tensors().values(), ref.state_tensors().values()):
        close(w1.optimizer.state[p]["momentum"], ref.optimizer.state[q]["momentum"], "momentum resharded")


def value_batches():
    """Datums for a value head: returns per token; sizes as `batches` (one smaller than dp)."""
    out = []
    for n, seed, loss in ((5, 41, "value_mse"), (1, 42, "value_mse"), (3, 43, "ppo_value")):
        datums = []
        for d in random_sft_datums(n, vocab=84, min_len=2, max_len=14, seed=seed):
            length = d.model_input.length
            g = torch.Generator().manual_seed(seed * 100 + length)
            inputs = {"returns": torch.randn(length, generator=g)}
            if loss == "ppo_value":
                inputs["old_values"] = torch.randn(length, generator=g) * 0.1
            datums.append(types.Datum(model_input=d.model_input, loss_fn_inputs=inputs))
        out.append((datums, loss))
    return out


VALUE_LR = 1e-5  # value-loss gradients reach ~1e2–1e3 (a sum of V − R over tokens): keep steps ~1e-3
VALUE_LAYOUTS = [("fsdp", None), ("replicate", None), ("tp", None), ("fsdp", types.LoraConfig(rank=4, seed=2))]


@PROCESS_ONLY
@pytest.mark.parametrize(("layout", "lora"), VALUE_LAYOUTS, ids=["fsdp", "hsdp-replicate", "tp", "fsdp-lora"])
def test_value_head_world2_matches_world1(group, tiny_model_dir, layout, lora, tmp_path):
    """A value head is replicated; its gradient is SUMmed over data-parallel ranks once per call."""
    name = f"value-{layout}-{'lora' if lora else 'full'}"
    cfg = config_for(layout)
    ref = TorchEngine.from_pretrained(tiny_model_dir, cfg, lora_config=lora, head="value")
    eng = GroupEngine.create(group, name, EngineSpec(str(tiny_model_dir), cfg, LAYOUTS[layout], lora, head="value"))
    try:
        assert eng.info().head == "value"
        for datums, loss in value_batches():
            close_outputs(eng.forward_backward(datums, loss), ref.forward_backward(datums, loss))
            grads = group.run(name, wt.full_grads)
            assert "head.score.weight" in grads and "lm_head.weight" not in grads
            close_dicts(grads, wt.full_grads(ref), f"{loss} grad")
            group.run(name, wt.sgd_step, VALUE_LR)
            wt.sgd_step(ref, VALUE_LR)
        # split over two calls: the head's earlier gradient is not reduced twice
        datums = value_batches()[0][0]
        eng.forward_backward(datums[:2], "value_mse"), eng.forward_backward(datums[2:], "value_mse")
        ref.forward_backward(datums, "value_mse")
        close_dicts(group.run(name, wt.full_grads), wt.full_grads(ref), "split grad")
        group.run(name, wt.sgd_step, VALUE_LR), wt.sgd_step(ref, VALUE_LR)
        close_dicts(group.run(name, wt.full_params), wt.full_params(ref), "param after SGD")
        close_dicts(eng.head_weights(), ref.head_weights(), "head_weights")
        eng.save_state(tmp_path / "w2")
        saved_out = eng.forward(datums, "value_mse")
    finally:
        eng.close()
    w1 = TorchEngine.from_pretrained(tiny_model_dir, cfg, lora_config=lora, head="value")
    w1.load_state(tmp_path / "w2")
    close_outputs(w1.forward(datums, "value_mse"), saved_out)


# ---------------------------------------------------------------------- faults (keep last: kills the group)
DETECT_S = 20.0  # generous bound for a loaded 2-core CI machine; detection itself is ~instant


def wait_all_dead(pids, timeout_s=15.0) -> list[int]:
    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
        except OSError:
            return False

    with contextlib.suppress(AssertionError):  # the caller asserts on the ranks left, naming them
        wait_until(lambda: not any(alive(p) for p in pids), timeout_s, message="every rank to exit")
    return [p for p in pids if alive(p)]


def test_killed_rank_surfaces_fast_then_rebuilt_group_resumes_from_checkpoint(group, tiny_model_dir, tmp_path):
    spec = EngineSpec(str(tiny_model_dir), CONFIG, ParallelismConfig(dp_shard=2))
    adam = types.AdamParams(learning_rate=1e-2)
    steps = [random_sft_datums(5, vocab=84, seed=s) for s in range(3)]
    pids = group.pids()
    engine = GroupEngine.create(group, "policy", spec)
    for datums in steps[:2]:
        engine.forward_backward(datums, "cross_entropy")
        engine.optim_step(adam)
    engine.save_state(tmp_path / "ckpt")
    engine.forward_backward(steps[2], "cross_entropy")
    engine.optim_step(adam)
    expected = group.run("policy", wt.full_params)  # the uninterrupted step 3

    killer = threading.Timer(1.0, os.kill, (pids[1], signal.SIGKILL))  # while rank 0 waits in a collective
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1"):
        group.run(None, wt.all_reduce_after_sleep, 1, 120.0)
    assert time.monotonic() - t0 < 1.0 + DETECT_S
    killer.join()
    with pytest.raises(WorkerError, match="broken"):
        engine.optim_step(adam)
    assert wait_all_dead(pids) == [], "no rank may outlive a failed group"

    rebuilt = make_group(group.runtime.name)
    try:
        engine = GroupEngine.create(rebuilt, "policy", spec)
        engine.load_state(tmp_path / "ckpt")
        assert engine.status().step == 2
        engine.forward_backward(steps[2], "cross_entropy")  # replay the step after the checkpoint
        assert engine.optim_step(adam)["step:max"] == 3
        got = rebuilt.run("policy", wt.full_params)
        for name, want in expected.items():
            assert torch.equal(got[name], want), name  # bit-identical resume
    finally:
        rebuilt.shutdown()
