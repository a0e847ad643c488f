"""A mixture-of-experts model under FSDP2 (dp_shard=2, CPU gloo) equals world 1: outputs,
gradients (full fine-tuning and expert LoRA), the auxiliary loss, and the routing metrics,
which the ranks sum before reporting (`RoutingStats.sum_over_ranks`). Expert parallelism
is not built; this is plain data parallelism with sharded parameters."""

import pytest
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.engine.parallel import ParallelismConfig
from ember.workers import EngineSpec, GroupEngine, WorkerGroup
from helpers import ranks as wt
from helpers.datums import random_sft_datums
from helpers.layouts import close_dicts, close_outputs

pytestmark = pytest.mark.slow  # a process group of two ranks

CONFIG = EngineConfig(micro_batch_tokens=16, moe_aux_loss_coef=0.05)  # several micro-batches per rank


@pytest.fixture(scope="module")
def group():
    g = WorkerGroup.create("process", world_size=2, call_timeout_s=300)
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    from ember.models.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe"), family="qwen3_moe", num_heads=2, num_kv_heads=2,
                            head_dim=32)


@pytest.mark.parametrize("lora", [None, types.LoraConfig(rank=4, seed=1)], ids=["full", "lora"])
def test_fsdp2_world2_matches_world1(group, qwen3_moe_dir, lora):
    name = f"moe-{'lora' if lora else 'full'}"
    ref = TorchEngine.from_pretrained(qwen3_moe_dir, CONFIG, lora_config=lora)
    eng = GroupEngine.create(group, name, EngineSpec(str(qwen3_moe_dir), CONFIG, ParallelismConfig(dp_shard=2),
                                                     lora_config=lora))
    try:
        for seed in (1, 2):
            datums = random_sft_datums(5, vocab=80, min_len=2, max_len=14, seed=seed)
            got, want = eng.forward_backward(datums, "cross_entropy"), ref.forward_backward(datums, "cross_entropy")
            close_outputs(got, want)
            for key in ("moe_load_imbalance:max", "moe_router_entropy:mean", "moe_aux_loss:sum"):
                assert got.metrics[key] == pytest.approx(want.metrics[key], rel=1e-5), key
            close_dicts(group.run(name, wt.full_grads), wt.full_grads(ref), "grad")
            group.run(name, wt.sgd_step, 1e-3)
            wt.sgd_step(ref, 1e-3)
    finally:
        eng.close()
