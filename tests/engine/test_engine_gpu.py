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


def test_offload_hands_reserved_memory_back_to_the_driver(tiny_model_dir):
    """Colocation: a vLLM engine (another process) can only use what this process's caching
    allocator gave back, so offload must lower reserved memory, not only allocated."""
    engine = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(device="cuda"))
    engine.forward_backward(random_sft_datums(4, vocab=84, seed=0), "cross_entropy")
    engine.optim_step(types.AdamParams(learning_rate=1e-3))
    reserved = torch.cuda.memory_reserved()
    engine.offload()
    assert torch.cuda.memory_reserved() < reserved
    engine.onload()
    engine.forward_backward(random_sft_datums(2, vocab=84, seed=1), "cross_entropy")  # still trains


def test_a_rank_process_returns_weights_in_host_memory(tiny_model_dir):
    """A CUDA tensor pickled back from a rank would unpickle on the GPU in the server (a CUDA
    context and a copy there); a rank in a process of its own returns host tensors."""
    from ember.workers import EngineSpec, GroupEngine, WorkerGroup

    with WorkerGroup.create("process", world_size=1, device="cuda", call_timeout_s=300) as g:
        eng = GroupEngine.create(g, "w", EngineSpec(str(tiny_model_dir), EngineConfig(device="cuda")))
        named = list(eng.named_weights())
    assert named and all(t.device.type == "cpu" for _, t in named)


def test_more_ranks_than_gpus_are_refused():
    from ember.workers import WorkerGroup

    with pytest.raises(ValueError, match="need a GPU each, and this machine has"):
        WorkerGroup.create("process", world_size=torch.cuda.device_count() + 1, device="cuda")


def test_a_torch_sampler_on_the_last_gpu_computes_there(tiny_model_dir):
    """The sampler follows the device it is given with its index (the service keeps the trainer's)."""
    from ember.sampling import SamplerConfig, TorchSampler

    device = f"cuda:{torch.cuda.device_count() - 1}"
    with TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(device=device, max_slots=2)) as s:
        assert s.model.device == torch.device(device)
        assert s.sample(types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2, seed=0)).sequences
