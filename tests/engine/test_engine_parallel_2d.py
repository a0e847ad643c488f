"""Two-dimensional meshes at world 4 (process runtime, CPU gloo): FSDP2 × TP, HSDP, replication
× TP, LoRA under FSDP2 × TP, and context × tensor parallelism (LoRA) — gradients and `named_weights` equal world 1 (fp32, rtol 1e-5,
atol 1e-5 · the largest gradient magnitude), so the SUM holds over both mesh dims."""

import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.engine.parallel import ParallelismConfig
from helpers.datums import random_sft_datums
from ember.workers import EngineSpec, GroupEngine, WorkerGroup
from helpers import ranks as wt

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

CONFIG = EngineConfig(micro_batch_tokens=32)
LAYOUTS = {
    "fsdp-x-tp": (ParallelismConfig(dp_shard=2, tp=2), None),
    "hsdp": (ParallelismConfig(dp_replicate=2, dp_shard=2), None),
    "replicate-x-tp": (ParallelismConfig(dp_replicate=2, tp=2), None),
    "lora-fsdp-x-tp": (ParallelismConfig(dp_shard=2, tp=2), types.LoraConfig(rank=4)),
    # Ulysses over the cp ranks of each TP index (2 heads per TP rank, 1 per cp rank), the
    # vocabulary-split lm_head under CP, FSDP2 over the flattened (dp_shard, cp) dims
    "cp-x-tp": (ParallelismConfig(cp=2, tp=2), types.LoraConfig(rank=4)),
    "cp-x-tp-full": (ParallelismConfig(cp=2, tp=2), None),
}


@pytest.fixture(scope="module")
def group4():
    g = WorkerGroup.create("process", world_size=4, call_timeout_s=300)
    yield g
    g.shutdown()


def assert_close_all(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    scale = max(float(t.abs().max()) for t in want.values())
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-5 * scale, msg=lambda m, n=n: f"{what} {n}: {m}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_world4_mesh_matches_world1(group4, tiny_model_dir, layout):
    pconfig, lora = LAYOUTS[layout]
    ref = TorchEngine.from_pretrained(tiny_model_dir, CONFIG, lora_config=lora)
    eng = GroupEngine.create(group4, layout, EngineSpec(str(tiny_model_dir), CONFIG, pconfig, lora))
    try:
        for seed in (1, 2):  # 7 datums over 2 data-parallel ranks; a second step after an SGD update
            datums = random_sft_datums(7, vocab=84, seed=seed)
            a, b = eng.forward_backward(datums, "cross_entropy"), ref.forward_backward(datums, "cross_entropy")
            assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-5)
            assert_close_all(group4.run(layout, wt.full_grads), wt.full_grads(ref), "grad")
            group4.run(layout, wt.sgd_step, 1e-3), wt.sgd_step(ref, 1e-3)
        assert_close_all(dict(eng.named_weights()), dict(ref.named_weights()), "named_weights")
    finally:
        eng.close()
