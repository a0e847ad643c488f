"""Fixtures for the sampling tests: one TorchSampler per tiny model, and a plain HF
model of the same weights for full-forward references."""

from __future__ import annotations

import pytest
import torch
from tinker import types

from ember.models import load_model
from ember.sampling import SamplerConfig, TorchSampler


@pytest.fixture(scope="session", params=["direct", "transformers"])
def sampler(tiny_model_dir, request):
    """Every test that takes it runs on both forward implementations (SamplerConfig.forward)."""
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
