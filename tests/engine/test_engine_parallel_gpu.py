"""CUDA paths of the parallel engine: NCCL, FSDP2 bf16 mixed precision (fp32 reduce), FSDP2
CPU offload, and colocation measured in CUDA memory. Marked `gpu`: skipped on CPU with the
reason printed; the multi-rank ones also need two GPUs.

Documented GPU bounds: fp32 world 2 vs world 1 gradients within rtol 1e-4 (TF32 off; NCCL's
reduction order differs from one process); bf16 mixed-precision logprobs within 0.1 nats
of fp32 (as tests/engine/test_engine_gpu.py).
"""

import gc

import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.engine.parallel import ParallelismConfig
from helpers.datums import random_sft_datums
from ember.workers import EngineSpec, GroupEngine, WorkerGroup
from helpers import ranks as wt

pytestmark = pytest.mark.gpu
BF16_LOGPROB_ATOL = 0.1
two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs for NCCL world 2"
)


@pytest.fixture(scope="module")
def nccl_group():
    torch.backends.cuda.matmul.allow_tf32 = False
    g = WorkerGroup.create("process", world_size=2, device="cuda", call_timeout_s=300)
    yield g
    g.shutdown()


@two_gpus
@pytest.mark.parametrize("layout", [ParallelismConfig(dp_shard=2), ParallelismConfig(tp=2)], ids=["fsdp", "tp"])
def test_nccl_fp32_world2_matches_world1(nccl_group, tiny_model_dir, layout):
    cfg = EngineConfig(device="cuda", micro_batch_tokens=16)
    datums = random_sft_datums(5, vocab=84, seed=1)
    ref = TorchEngine.from_pretrained(tiny_model_dir, cfg)
    eng = GroupEngine.create(nccl_group, "exact", EngineSpec(str(tiny_model_dir), cfg, layout))
    try:
        a, b = eng.forward_backward(datums, "cross_entropy"), ref.forward_backward(datums, "cross_entropy")
        assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-4)
        got, want = nccl_group.run("exact", wt.full_grads), wt.full_grads(ref)
        scale = max(float(t.abs().max()) for t in want.values())
        for n in want:
            torch.testing.assert_close(got[n], want[n].cpu(), rtol=1e-4, atol=1e-4 * scale)
    finally:
        eng.close()


@two_gpus
@pytest.mark.parametrize("cpu_offload", [False, True], ids=["mixed-precision", "mixed-precision+cpu-offload"])
def test_fsdp_bf16_mixed_precision_trains(nccl_group, tiny_model_dir, cpu_offload):
    cfg = EngineConfig(device="cuda", autocast_dtype="bfloat16")
    layout = ParallelismConfig(dp_shard=2, cpu_offload=cpu_offload)
    datums = random_sft_datums(6, vocab=84, seed=2)
    ref = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(device="cuda"))
    eng = GroupEngine.create(nccl_group, "bf16", EngineSpec(str(tiny_model_dir), cfg, layout))
    try:
        a, b = eng.forward_backward(datums, "cross_entropy"), ref.forward(datums, "cross_entropy")
        for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs):
            torch.testing.assert_close(x["logprobs"].to_torch(), y["logprobs"].to_torch(), rtol=0, atol=BF16_LOGPROB_ATOL)
        metrics = eng.optim_step(types.AdamParams(learning_rate=1e-3))
        assert torch.isfinite(torch.tensor(metrics["grad_norm:mean"]))
        params = nccl_group.run("bf16", wt.full_params)
        assert all(p.dtype == torch.float32 for p in params.values())  # fp32 master weights
    finally:
        eng.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_colocation_offload_lowers_peak_cuda_memory(tiny_model_dir):
    """Two engines on one GPU: with colocation the idle one's state leaves the device."""
    spec = EngineSpec(str(tiny_model_dir), EngineConfig(device="cuda"))
    datums = random_sft_datums(4, vocab=84, seed=3)
    peaks = {}
    for colocate in (False, True):
        gc.collect()  # the first pass's engines are in reference cycles (engine <-> head): gone only now
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with WorkerGroup.create("inline", device="cuda", colocate=colocate) as g:
            a, b = GroupEngine.create(g, "a", spec), GroupEngine.create(g, "b", spec)
            for engine in (a, b, a, b):
                engine.forward_backward(datums, "cross_entropy")
                engine.optim_step(types.AdamParams(learning_rate=1e-3))
            assert g.memory()[0]["onloaded"] == (["b"] if colocate else ["a", "b"])
            peaks[colocate] = torch.cuda.max_memory_allocated() - base
            del a, b
    assert peaks[True] < peaks[False]


@two_gpus
def test_fsdp2_offload_and_onload_keep_the_weights_and_training(nccl_group, tiny_model_dir):
    """Colocation moves an FSDP2 model with `.to()` (FSDP2 re-registers its sharded parameters)."""
    layout = ParallelismConfig(dp_shard=2)
    eng = GroupEngine.create(nccl_group, "move", EngineSpec(str(tiny_model_dir), EngineConfig(device="cuda"), layout))
    datums = random_sft_datums(4, vocab=84, seed=4)
    try:
        eng.forward_backward(datums, "cross_entropy")
        eng.optim_step(types.AdamParams(learning_rate=1e-3))
        before = eng.forward(datums, "cross_entropy").loss_fn_outputs
        eng.offload()
        eng.onload()
        after = eng.forward(datums, "cross_entropy").loss_fn_outputs
        for x, y in zip(before, after):
            assert torch.equal(x["logprobs"].to_torch(), y["logprobs"].to_torch())
        eng.forward_backward(datums, "cross_entropy")
        assert torch.isfinite(torch.tensor(eng.optim_step(types.AdamParams(learning_rate=1e-3))["grad_norm:mean"]))
    finally:
        eng.close()


@two_gpus
def test_fsdp2_fp16_autocast_computes_in_fp16(nccl_group, tiny_model_dir):
    """fp16 autocast under FSDP2 on GPU is FSDP2's fp16 param_dtype (it silently ran fp32):
    the logprobs differ from fp32's, within the fp16 bound."""
    from ember.models.dtypes import LOGPROB_ATOL

    datums = random_sft_datums(4, vocab=84, seed=5)
    layout = ParallelismConfig(dp_shard=2)
    outs = {}
    configs = {"fp32": EngineConfig(device="cuda"), "fp16": EngineConfig(device="cuda", autocast_dtype="float16")}
    for name, cfg in configs.items():
        eng = GroupEngine.create(nccl_group, name, EngineSpec(str(tiny_model_dir), cfg, layout))
        try:
            outs[name] = [o["logprobs"].to_torch() for o in eng.forward(datums, "cross_entropy").loss_fn_outputs]
        finally:
            eng.close()
    assert any(not torch.equal(a, b) for a, b in zip(outs["fp16"], outs["fp32"]))
    for a, b in zip(outs["fp16"], outs["fp32"]):
        torch.testing.assert_close(a, b, rtol=0, atol=LOGPROB_ATOL["float16"])
