"""Expert parallelism (`ParallelismConfig.ep`, `ember.engine.expert_parallel`) on CPU gloo:
ep=2 at world 2 (dp_shard=2: every rank holds half of each layer's experts) and ep=2 within
dp_shard=4 at world 4 (two ep groups, each expert on two replicas) equal world 1 — losses,
logprobs, routing metrics, gradients, parameters after SGD steps and a forward after them —
for full fine-tuning and expert LoRA (gpt-oss's biased experts too); checkpoints saved at
ep=2 load at world 1 and back, and its adapter export equals world 1's; one case on the
Ray runtime; last, a rank killed while the other waits in the dispatch's all-to-all
surfaces within seconds.

Tolerances as tests/engine/test_engine_parallel.py (helpers/layouts.py): rtol 1e-5, with
atol 1e-5 · the largest reference magnitude; a sum over the ranks' tokens changes fp32
rounding, nothing else.
"""

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
from ember.workers import EngineSpec, GroupEngine, WorkerDiedError, WorkerError, WorkerGroup
from helpers import ranks as wt
from helpers.datums import random_sft_datums
from helpers.layouts import check_params_then_align, close_dicts, close_outputs

pytestmark = pytest.mark.slow  # process groups of two and four ranks

CONFIG = EngineConfig(micro_batch_tokens=16, moe_aux_loss_coef=0.05)  # several micro-batches per rank
LR = 1e-3
LORA = types.LoraConfig(rank=4, seed=1)
METRICS = ("moe_load_imbalance:max", "moe_router_entropy:mean", "moe_aux_loss:sum")


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    from ember.models.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe-ep"), family="qwen3_moe", num_heads=2, num_kv_heads=2,
                            head_dim=32)


def random_b(ref: TorchEngine, group: WorkerGroup, name: str, seed: int = 3) -> None:
    """A fresh adapter's B is 0, which would leave A's gradient 0: give every B the same
    random values on the reference and on the ranks."""
    g = torch.Generator().manual_seed(seed)
    values = {n: torch.randn(p.shape, generator=g) * 0.05 for n, p in ref.state_tensors().items() if ".lora_B." in n}
    wt.set_params(ref, values)
    group.run(name, wt.set_params, values)


def compare_training(group: WorkerGroup, model_dir, layout: ParallelismConfig, lora) -> None:
    name = f"ep-{'lora' if lora else 'full'}"
    ref = TorchEngine.from_pretrained(model_dir, CONFIG, lora_config=lora)
    eng = GroupEngine.create(group, name, EngineSpec(str(model_dir), CONFIG, layout, lora_config=lora))
    try:
        if lora:
            random_b(ref, group, name)
        for seed in (1, 2):
            datums = random_sft_datums(6, vocab=80, min_len=2, max_len=14, seed=seed)
            got, want = eng.forward_backward(datums, "cross_entropy"), ref.forward_backward(datums, "cross_entropy")
            close_outputs(got, want)
            for key in METRICS:
                assert got.metrics[key] == pytest.approx(want.metrics[key], rel=1e-5), key
            close_dicts(group.run(name, wt.full_grads), wt.full_grads(ref), "grad")
            group.run(name, wt.sgd_step, LR)
            wt.sgd_step(ref, LR)
        check_params_then_align(ref, group.run(name, wt.full_params))
        datums = random_sft_datums(4, vocab=80, min_len=2, max_len=14, seed=3)
        close_outputs(eng.forward(datums, "cross_entropy"), ref.forward(datums, "cross_entropy"))
    finally:
        eng.close()


@pytest.fixture(scope="module")
def group2():
    g = WorkerGroup.create("process", world_size=2, call_timeout_s=300)
    yield g
    g.shutdown()


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_ep2_world2_matches_world1(group2, qwen3_moe_dir, lora):
    compare_training(group2, qwen3_moe_dir, ParallelismConfig(dp_shard=2, ep=2), lora)


def test_each_rank_holds_its_share_of_the_experts_and_lora(group2, qwen3_moe_dir):
    """Rank 0 holds half of each expert adapter's A; `named_weights` (what weight sync and
    exports read) gathers the whole adapter, equal to world 1's (same seed)."""
    layout = ParallelismConfig(dp_shard=2, ep=2)
    eng = GroupEngine.create(group2, "ep-shapes", EngineSpec(str(qwen3_moe_dir), CONFIG, layout, lora_config=LORA))
    try:
        local, full = group2.run("ep-shapes", wt.local_shapes), group2.run("ep-shapes", wt.full_params)
        named = dict(eng.named_weights())
    finally:
        eng.close()
    experts = [n for n in full if ".mlp.experts." in n and ".lora_A." in n]
    assert experts
    for name in experts:  # A (E * r, in): this rank's E/2 experts' rows
        assert local[name] == (full[name].shape[0] // 2, full[name].shape[1]), name
    want = dict(TorchEngine.from_pretrained(qwen3_moe_dir, CONFIG, lora_config=LORA).named_weights())
    assert set(named) == set(want) and any(".mlp.experts." in n for n in want)
    for name, t in want.items():
        assert torch.equal(named[name], t), name


def test_gpt_oss_ep2_matches_world1(group2, tmp_path_factory):
    """Biased, transposed experts with gpt-oss's gate: the biases are split with the weights."""
    from ember.models.testing import build_tiny_model

    model_dir = build_tiny_model(tmp_path_factory.mktemp("gpt-oss-ep"), family="gpt_oss", num_heads=2,
                                 num_kv_heads=2, head_dim=32)
    compare_training(group2, model_dir, ParallelismConfig(dp_shard=2, ep=2), None)


def test_checkpoint_saved_at_ep2_loads_at_world1_and_back(group2, qwen3_moe_dir, tmp_path):
    adam = types.AdamParams(learning_rate=1e-2)
    spec = EngineSpec(str(qwen3_moe_dir), CONFIG, ParallelismConfig(dp_shard=2, ep=2), lora_config=LORA)
    first, nxt = random_sft_datums(5, vocab=80, seed=21), random_sft_datums(3, vocab=80, seed=22)
    eng = GroupEngine.create(group2, "ep-save", spec)
    try:
        eng.forward_backward(first, "cross_entropy")
        eng.optim_step(adam)
        eng.save_state(tmp_path / "ep2")
        eng.export_hf(tmp_path / "hf-ep2")  # rank 0 writes the gathered adapter
        saved = group2.run("ep-save", wt.full_params)
        out2 = eng.forward_backward(nxt, "cross_entropy")
    finally:
        eng.close()
    w1 = TorchEngine.from_pretrained(qwen3_moe_dir, CONFIG, lora_config=LORA)
    w1.load_state(tmp_path / "ep2")
    assert w1.step == 1
    for n, p in wt.full_params(w1).items():
        assert torch.equal(p, saved[n]), n  # loading reshards exactly
    w1.export_hf(tmp_path / "hf-w1")
    exported = [load_file(tmp_path / d / "adapter_model.safetensors") for d in ("hf-ep2", "hf-w1")]
    assert exported[0].keys() == exported[1].keys()
    assert all(torch.equal(exported[0][n], exported[1][n]) for n in exported[1])
    close_outputs(w1.forward_backward(nxt, "cross_entropy"), out2)
    w1.optim_step(adam)  # Adam moments of the ep=2 run, loaded at world 1
    w1.save_state(tmp_path / "w1")
    back = GroupEngine.create(group2, "ep-load", spec)
    try:
        back.load_state(tmp_path / "w1")
        assert back.status().step == 2
        loaded = group2.run("ep-load", wt.full_params)
        for n, p in wt.full_params(w1).items():
            assert torch.equal(loaded[n], p), n
        close_outputs(back.forward_backward(first, "cross_entropy"), w1.forward_backward(first, "cross_entropy"))
    finally:
        back.close()


@pytest.fixture(scope="module")
def group4():
    g = WorkerGroup.create("process", world_size=4, call_timeout_s=600)
    yield g
    g.shutdown()


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_ep2_within_dp_shard4_world4_matches_world1(group4, qwen3_moe_dir, lora):
    """Two ep groups ({0, 1}, {2, 3}); each expert's two replicas sum their gradients."""
    compare_training(group4, qwen3_moe_dir, ParallelismConfig(dp_shard=4, ep=2), lora)


def test_ep2_on_ray_matches_world1(ray_cluster, qwen3_moe_dir):
    ray_cluster.start()
    group = WorkerGroup.create("ray", world_size=2, call_timeout_s=300)
    try:
        compare_training(group, qwen3_moe_dir, ParallelismConfig(dp_shard=2, ep=2), LORA)
    finally:
        group.shutdown()


# ---------------------------------------------------------------------- faults (keep last: kills group2)
DETECT_S = 20.0  # generous bound for a loaded 2-core machine; detection itself is ~instant


def test_rank_killed_mid_dispatch_surfaces_fast(group2, qwen3_moe_dir):
    eng = GroupEngine.create(group2, "ep-kill", EngineSpec(str(qwen3_moe_dir), CONFIG,
                                                         ParallelismConfig(dp_shard=2, ep=2)))
    eng.forward_backward(random_sft_datums(4, vocab=80, seed=5), "cross_entropy")
    pids = group2.pids()
    killer = threading.Timer(1.0, os.kill, (pids[1], signal.SIGKILL))  # while rank 0 waits in the all-to-all
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1"):
        group2.run("ep-kill", wt.expert_dispatch_after_sleep, 1, 120.0)
    assert time.monotonic() - t0 < 1.0 + DETECT_S
    killer.join()
    with pytest.raises(WorkerError, match="broken"):
        eng.forward(random_sft_datums(2, vocab=80, seed=6), "cross_entropy")
