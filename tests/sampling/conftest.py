"""Fixtures for the sampling tests: one sampler per backend over the tiny model, and a
plain HF model of the same weights for full-forward references.

`sampler` runs every test that takes it on each backend: TorchSampler with both forward
implementations, VLLMSampler (one vLLM engine for the whole session: it takes
20-50 s to start) and a `SamplerPool` of two local TorchSampler replicas ("pool": the
same semantics must hold whichever replica serves a request). A test that cannot hold
for a backend says why with `not_on`."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from tinker import types

from ember.models import load_model
from ember.sampling import SamplerConfig, TorchSampler
from ember.sampling.registry import backend_missing
from helpers.scheduling import register_stop


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_vllm_model_dir):
    """The sampling tests run every backend on one model: vLLM's CPU attention needs head_dim >= 32."""
    return tiny_vllm_model_dir


BACKENDS = ["direct", "transformers", "vllm", "pool"]  # TorchSampler's two forwards, vLLM, a 2-replica pool


SLOW_BACKENDS = ("vllm", "pool")  # an engine start of 20-50 s; two replica processes to start


def backend_param(backend: str, *marks):
    """A `sampler` parameter; vLLM's and the pool's are `slow` (see SLOW_BACKENDS), so
    `make test-fast` runs the sampler tests on TorchSampler only (test_sampling_pool.py
    runs there on the pool)."""
    return pytest.param(backend, marks=[*marks, *([pytest.mark.slow] if backend in SLOW_BACKENDS else [])])


def vllm_missing() -> str | None:
    """Why vLLM cannot run here, or None."""
    return backend_missing("vllm")


def not_on(backend: str, reason: str, *more: tuple[str, str]):
    """Run a `sampler` test on every backend but `backend`, which is skipped with `reason`
    (and each further (backend, reason) pair)."""
    skips = dict([(backend, reason), *more])
    values = [backend_param(b, pytest.mark.skip(reason=f"{b}: {skips[b]}")) if b in skips else backend_param(b)
              for b in BACKENDS]
    return pytest.mark.parametrize("sampler", values, indirect=True)


# replica_timeout_s: test_sampling_pool.py silences a replica and waits this out.
POOL_CONFIG = dict(replicas=2, max_slots=16, max_len=256, forward="direct", replica_timeout_s=20.0, max_imbalance=64)


@pytest.fixture(scope="session")
def pool_sampler(tiny_model_dir, request):
    """The session's SamplerPool: two TorchSampler replica processes (fp32 CPU), closed after
    its last test (helpers.scheduling)."""
    from ember.sampling.pool import SamplerPool

    s = SamplerPool(tiny_model_dir, SamplerConfig(**POOL_CONFIG))
    register_stop(request.config, "pool_sampler", s.close)
    yield s
    s.close()


@pytest.fixture(scope="session")
def vllm_sampler(tiny_model_dir, request):
    """The session's VLLMSampler (fp32 CPU, raw logprobs, LoRA up to rank 8), closed after its
    last test (helpers.scheduling: an idle engine core burns ~4% of a core)."""
    reason = vllm_missing()
    if reason:
        pytest.skip(reason=reason)
    from ember.sampling import VLLMSampler

    cfg = SamplerConfig(backend="vllm", max_slots=16, max_len=256, max_logprobs=128, max_loras=4, max_lora_rank=8)
    s = VLLMSampler.from_pretrained(tiny_model_dir, cfg)
    register_stop(request.config, "vllm_sampler", s.close)
    yield s
    s.close()


@pytest.fixture(scope="session", params=[backend_param(b) for b in BACKENDS])
def sampler(tiny_model_dir, request):
    """Every test that takes it runs on each backend (see BACKENDS)."""
    if request.param in ("vllm", "pool"):
        yield request.getfixturevalue(f"{request.param}_sampler")
        return
    s = TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(max_slots=16, max_len=256, forward=request.param))
    yield s
    s.close()


@pytest.fixture(scope="session")
def ref_model(tiny_model_dir):
    return load_model(tiny_model_dir).eval()


def full_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """logp(tokens[i] | tokens[:i]) for i >= 1 from one plain forward (no cache, no mask)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return logp.gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1)


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """Argmax decoding by re-running the whole sequence each step (no KV cache)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def params(**kw) -> types.SamplingParams:
    return types.SamplingParams(**kw)


def prompt(tokens) -> types.ModelInput:
    return types.ModelInput.from_ints(list(tokens))


# in-flight weights adopted mid-sequence (test_sampling_follow.py, test_sampling_vllm_follow.py)
def perturbed(model, seed: int):
    """A copy of `model` with every weight moved by noise (a 'newer' in-flight save)."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    return other


def mixed_cache_logprobs(old, new, tokens: list[int], first_new: int) -> np.ndarray:
    """logp of tokens[first_new:] when the KV of tokens[:first_new - 1] comes from `old`
    and every later token runs through `new` (what a mid-sequence swap computes)."""
    with torch.no_grad():
        past = old(torch.tensor([tokens[: first_new - 1]]), use_cache=True).past_key_values
        logits = new(torch.tensor([tokens[first_new - 1: -1]]), past_key_values=past).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(tokens[first_new:])[:, None]).squeeze(1).numpy()


def old_logprobs(model, tokens: list[int], upto: int) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([tokens[: upto - 1]])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(tokens[1:upto])[:, None]).squeeze(1).numpy()
