"""Context parallelism (`ParallelismConfig(cp=2)`, Ulysses attention, CPU gloo) equals world 1.

One request holds a 4,096-token datum (a micro-batch of its own, split 2,048 | 2,048 over
the cp ranks) and three short datums packed into a second micro-batch whose rows cross the
shard seam (lengths 300 | 180 + 121: the 180/121 boundary lies in the second shard, the
first shard ends inside the 180-token datum), for Qwen3 and Llama, LoRA and full, packed
and padded, on the `process` runtime (and one case on `ray`). Losses, per-token logprobs
and every gradient agree with world 1 at rtol 1e-5 (fp32), with atol 1e-5 · the largest
reference magnitude for entries near zero (a sum over two ranks changes fp32 rounding).
The models are tiny (hidden 64, 2 layers) with 4,096 positions: the equality matters, not
the size; a case takes a few seconds alone.
"""

import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.engine.parallel import ParallelismConfig
from ember.models.testing import build_tiny_model
from ember.workers import EngineSpec, GroupEngine, WorkerGroup
from helpers import ranks as wt
from helpers.layouts import check_params_then_align, close, close_outputs
from helpers.datums import random_rl_datums, random_sft_datums

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

LONG = 4096
CP = ParallelismConfig(cp=2)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {family: build_tiny_model(tmp_path_factory.mktemp(f"cp-{family}"), family=family, seed=3,
                                     max_position_embeddings=LONG)
            for family in ("qwen3", "llama")}


@pytest.fixture(scope="module", params=["process", "ray"])
def group(request, ray_cluster):
    if request.param == "ray":
        ray_cluster.start()  # the group joins the worker's cluster
    g = WorkerGroup.create(request.param, world_size=2, call_timeout_s=600)
    yield g
    g.shutdown()


def datums() -> list[types.Datum]:
    long = random_sft_datums(1, vocab=84, min_len=LONG, max_len=LONG, seed=11)
    short = [random_sft_datums(1, vocab=84, min_len=n, max_len=n, seed=12 + n)[0] for n in (300, 180, 121)]
    return long + short


def close_grads(got: dict, want: dict) -> None:
    assert set(got) == set(want) and want
    scale = max(float(t.abs().max()) for t in want.values())
    for name in want:
        close(got[name], want[name], f"grad {name}", scale)


CASES = [(r, f, m, p) for r in ("process", "ray") for f in ("qwen3", "llama") for m in ("lora", "full")
         for p in ("packed", "padded") if r == "process" or (f, m, p) == ("qwen3", "lora", "packed")]


# scope="module": with direct arguments beside the indirect `group`, pytest would scope the
# parameter per test and start a group for every case.
@pytest.mark.parametrize(("group", "family", "mode", "packing"), CASES, indirect=["group"], scope="module")
def test_cp2_equals_world1_on_a_4096_token_datum(group, model_dirs, family, mode, packing):
    config = EngineConfig(micro_batch_tokens=LONG, packing=packing == "packed")
    lora = types.LoraConfig(rank=4) if mode == "lora" else None
    name = f"cp-{family}-{mode}-{packing}"
    ref = TorchEngine.from_pretrained(model_dirs[family], config, lora_config=lora)
    eng = GroupEngine.create(group, name, EngineSpec(str(model_dirs[family]), config, CP, lora))
    try:
        assert eng.info().parallel == CP.as_dict()
        batch = datums()
        close_outputs(eng.forward_backward(batch, "cross_entropy"), ref.forward_backward(batch, "cross_entropy"))
        close_grads(group.run(name, wt.full_grads), wt.full_grads(ref))
        # a loss that reads logprobs and advantages, without backward, after an update
        group.run(name, wt.sgd_step, 1e-3), wt.sgd_step(ref, 1e-3)
        check_params_then_align(ref, group.run(name, wt.full_params))
        rl = random_rl_datums(3, vocab=84, min_len=200, max_len=700, seed=5)
        close_outputs(eng.forward(rl, "importance_sampling"), ref.forward(rl, "importance_sampling"))
    finally:
        eng.close()
