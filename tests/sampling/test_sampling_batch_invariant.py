"""Batch-invariant mode (`EngineConfig.batch_invariant` + `SamplerConfig.batch_invariant`):
the trainer's `forward` logprobs of sampled tokens equal TorchSampler's bitwise
(torch.equal), for full weights and LoRA, prompts of several lengths in one batch, and a
request's tokens and logprobs do not depend on what else is in its batch. The tolerance
tests of the default mode are in test_sampling_exactness.py, unchanged."""

from __future__ import annotations

import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler
from ember.service.config import ServiceConfig

from .conftest import prompt

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def bi_sampler(tiny_model_dir):
    sampler = TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(batch_invariant=True))
    yield sampler
    sampler.close()


def _requests(version, prompts=PROMPTS, seed0=0):
    return [SamplingRequest(prompt=prompt(p), num_samples=2, version=version,
                            sampling_params=types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0,
                                                                 seed=seed0 + i, stop=[]))
            for i, p in enumerate(prompts)]


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def _train_one_step(engine: TorchEngine) -> None:
    """One optimizer step, so a LoRA adapter's B is no longer zero (its delta counts)."""
    engine.forward_backward([_datum(p + p) for p in PROMPTS], "cross_entropy")
    engine.optim_step(types.AdamParams(learning_rate=5e-2))


@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["full", "lora"])
def test_trainer_forward_equals_sampler_bitwise(lora, tiny_model_dir, bi_sampler):
    lora_config = types.LoraConfig(rank=4, seed=3) if lora else None
    engine = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(batch_invariant=True), lora_config=lora_config)
    _train_one_step(engine)
    version = bi_sampler.load_weights(engine.named_weights(), lora_config=lora_config)
    responses = bi_sampler.sample_many(_requests(version), timeout=300)
    datums, sampled, starts = [], [], []
    for p, response in zip(PROMPTS, responses):
        for seq in response.sequences:
            datums.append(_datum(p + seq.tokens))
            sampled.append(torch.tensor(seq.logprobs, dtype=torch.float32))
            starts.append(len(p) - 1)
    out = engine.forward(datums, "cross_entropy")
    for got, start, want in zip(out.loss_fn_outputs, starts, sampled):
        trainer = got["logprobs"].to_torch()[start:]
        assert torch.equal(trainer, want), (trainer - want).abs().max()


def test_request_alone_equals_request_in_a_batch(bi_sampler):
    together = bi_sampler.sample_many(_requests(None), timeout=300)
    alone = bi_sampler.sample_many(_requests(None, PROMPTS[:1]), timeout=300)[0]
    # a different batch again: the same request after two others of other lengths
    reordered = bi_sampler.sample_many(_requests(None, PROMPTS[::-1], seed0=0), timeout=300)
    for seq_alone, seq_batch in zip(alone.sequences, together[0].sequences):
        assert seq_alone.tokens == seq_batch.tokens
        assert seq_alone.logprobs == seq_batch.logprobs  # floats compared exactly
    # PROMPTS[1] keeps seed 1 in both orders (the middle of three)
    for a, b in zip(reordered[1].sequences, together[1].sequences):
        assert (a.tokens, a.logprobs) == (b.tokens, b.logprobs)


def test_prompt_logprobs_equal_trainer_bitwise(tiny_model_dir, bi_sampler):
    engine = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(batch_invariant=True))
    tokens = PROMPTS[0] + PROMPTS[2]
    scored = torch.tensor(bi_sampler.compute_logprobs(prompt(tokens))[1:], dtype=torch.float32)
    trainer = engine.forward([_datum(tokens)], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_torch()
    assert torch.equal(scored, trainer)


def test_one_setting_for_trainer_and_sampler(tmp_path):
    """`--engine.batch_invariant` turns the service's sampler on too; vLLM is then refused."""
    config = ServiceConfig(data_dir=tmp_path, engine=EngineConfig(batch_invariant=True))
    assert config.sampler.batch_invariant is True
    assert ServiceConfig(data_dir=tmp_path).sampler.batch_invariant is False
    with pytest.raises(ValueError, match="needs the torch backend"):
        ServiceConfig(data_dir=tmp_path, engine=EngineConfig(batch_invariant=True), sampler=SamplerConfig(backend="vllm"))


def test_refusals():
    with pytest.raises(ValueError, match="needs the torch backend"):
        SamplerConfig(backend="vllm", batch_invariant=True)
    with pytest.raises(ValueError, match="forward='direct'"):
        SamplerConfig(forward="direct", batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant with compile"):
        EngineConfig(batch_invariant=True, compile=True)
