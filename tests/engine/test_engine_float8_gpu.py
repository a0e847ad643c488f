"""`EngineConfig.float8` on a GPU: a few full fine-tuning steps of a small model through
torchao's float8 linear layers track the same steps in bf16, on one GPU and under FSDP2 at
world 2 (float8 all-gather, the scales precomputed after each optim_step). Marked `gpu`:
skipped on CPU with the reason printed; also skipped, saying why, below compute capability
8.9 or without torchao; the FSDP2 case needs two GPUs.

Tolerance: each step's loss within 5% (relative) of bf16's. float8 e4m3 keeps 3 mantissa
bits (unit roundoff 2^-4 = 6.25% per element) with a dynamic per-tensor scale; the rounding
of the inputs, weights and output gradients averages out over each dot product, and a
cross-entropy loss near log(vocab) moves far less than the logits do. torchao's own tests
accept float8 linear outputs at an SQNR of about 20 dB (10% relative error); 5% on the loss
is looser than what the arithmetic predicts and tight enough to catch a wrong scale or a
dropped layer (either moves the loss by much more)."""

import importlib.util

import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.engine.parallel import ParallelismConfig
from ember.workers import EngineSpec, GroupEngine, WorkerGroup
from helpers.datums import random_sft_datums

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="float8 matmuls need a GPU of compute capability >= 8.9 (Ada/Hopper)"),
    pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                       reason="torchao is not installed (pip install 'ember[float8]')"),
]
LOSS_RTOL = 0.05
STEPS = 3
ADAM = types.AdamParams(learning_rate=1e-3)
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs for NCCL world 2")


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    """Every decoder projection a multiple of 16 wide, so float8 covers all of them."""
    from ember.models.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-f8"), family="qwen3", seed=0,
                            hidden_size=128, intermediate_size=256)


def _losses(engine, batches) -> list[float]:
    losses = []
    for batch in batches:
        losses.append(engine.forward_backward(batch, "cross_entropy").metrics["loss:sum"])
        engine.optim_step(ADAM)
    return losses


def _batches():
    return [random_sft_datums(8, vocab=84, seed=s) for s in range(STEPS)]


def test_float8_losses_track_bf16(wide_model_dir):
    bf16 = TorchEngine.from_pretrained(wide_model_dir, EngineConfig(device="cuda", dtype="bfloat16"))
    f8 = TorchEngine.from_pretrained(wide_model_dir, EngineConfig(device="cuda", dtype="bfloat16", float8=True))
    assert any(type(m).__name__ == "Float8Linear" for m in f8.model.modules())
    assert type(f8.model.lm_head).__name__ == "Linear"  # the output embedding stays in bf16
    want, got = _losses(bf16, _batches()), _losses(f8, _batches())
    for step, (a, b) in enumerate(zip(got, want)):
        assert a == pytest.approx(b, rel=LOSS_RTOL), f"step {step}: float8 {a} vs bf16 {b}"


@two_gpus
def test_float8_under_fsdp2_world2_tracks_bf16(wide_model_dir):
    bf16 = TorchEngine.from_pretrained(wide_model_dir, EngineConfig(device="cuda", dtype="bfloat16"))
    want = _losses(bf16, _batches())
    cfg = EngineConfig(device="cuda", dtype="bfloat16", float8=True)
    with WorkerGroup.create("process", world_size=2, device="cuda", call_timeout_s=300) as group:
        eng = GroupEngine.create(group, "f8", EngineSpec(str(wide_model_dir), cfg, ParallelismConfig(dp_shard=2)))
        try:
            got = _losses(eng, _batches())
        finally:
            eng.close()
    for step, (a, b) in enumerate(zip(got, want)):
        assert a == pytest.approx(b, rel=LOSS_RTOL), f"step {step}: float8 FSDP2 {a} vs bf16 {b}"
