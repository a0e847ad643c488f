"""CUDA paths: bf16 autocast and bf16 parameters. Marked `gpu`: skipped on CPU with the reason printed."""

import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from helpers.datums import random_sft_datums

pytestmark = pytest.mark.gpu

# Documented GPU/bf16 bound: bf16 logprobs within 0.1 nats of fp32 on the tiny model.
BF16_LOGPROB_ATOL = 0.1


@pytest.mark.parametrize("cfg", [
    EngineConfig(device="cuda", autocast_dtype="bfloat16"),
    EngineConfig(device="cuda", dtype="bfloat16"),
], ids=["autocast-bf16", "bf16-params"])
def test_cuda_bf16_training_step(tiny_model_dir, cfg):
    datums = random_sft_datums(4, vocab=84, seed=0)
    ref = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(device="cuda"))
    engine = TorchEngine.from_pretrained(tiny_model_dir, cfg)
    a = ref.forward(datums, "cross_entropy")
    b = engine.forward_backward(datums, "cross_entropy")
    for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs):
        torch.testing.assert_close(y["logprobs"].to_torch(), x["logprobs"].to_torch(), rtol=0, atol=BF16_LOGPROB_ATOL)
    metrics = engine.optim_step(types.AdamParams(learning_rate=1e-3))
    assert torch.isfinite(torch.tensor(metrics["grad_norm:mean"]))
    assert next(engine.model.parameters()).device.type == "cuda"
