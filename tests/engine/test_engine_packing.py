"""Packed micro-batches never let one sequence attend to another."""

import torch

from ember.engine import EngineConfig, TorchEngine
from ember.engine.testing import random_sft_datums
from ember.models import load_model


def test_packed_logprobs_equal_single_sequence_forwards(tiny_model_dir):
    datums = random_sft_datums(6, vocab=84, min_len=1, max_len=20, seed=5)
    engine = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(micro_batch_tokens=10_000))
    out = engine.forward(datums, "cross_entropy")
    assert engine.status().accumulated_micro_batches == 0  # forward accumulates nothing
    model = load_model(tiny_model_dir)
    for d, o in zip(datums, out.loss_fn_outputs):
        ids = torch.tensor([d.model_input.to_ints()])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
        targets = d.loss_fn_inputs["target_tokens"].to_torch()
        expected = logp.gather(1, targets.unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(o["logprobs"].to_torch(), expected, rtol=1e-5, atol=1e-5)
        assert o["logprobs"].shape == list(targets.shape)


def test_forward_leaves_no_gradient_and_no_change(tiny_model_dir):
    datums = random_sft_datums(3, vocab=84, seed=2)
    engine = TorchEngine.from_pretrained(tiny_model_dir)
    a = engine.forward(datums, "cross_entropy")
    assert all(p.grad is None for p in engine.state_tensors().values())
    b = engine.forward(datums, "cross_entropy")
    assert a.metrics == b.metrics
