"""`EngineConfig.batch_invariant`: what the engine refuses, and that its `forward` logprobs
of a sequence do not depend on the other datums of the call (packing, padding) nor on
the micro-batch budget. Equality with TorchSampler: tests/sampling/test_sampling_batch_invariant.py."""

from __future__ import annotations

import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.engine.parallel import ParallelismConfig


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def test_refused_with_compile_and_with_more_than_one_rank(tiny_model_dir):
    with pytest.raises(ValueError, match="batch_invariant with compile"):
        EngineConfig(batch_invariant=True, compile=True)
    with pytest.raises(ValueError, match="runs on one device"):
        TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(batch_invariant=True),
                                    parallelism=ParallelismConfig(dp_shard=2))


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_a_sequence_scores_the_same_in_any_call(packing, tiny_model_dir):
    engine = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(batch_invariant=True, packing=packing))
    seq = [5, 6, 7, 8, 9, 10, 11, 12]
    alone = engine.forward([_datum(seq)], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_torch()
    others = [_datum([20, 21, 22]), _datum(seq), _datum(list(range(30, 50)))]
    together = engine.forward(others, "cross_entropy").loss_fn_outputs[1]["logprobs"].to_torch()
    assert torch.equal(alone, together)
    plain = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(packing=packing))
    reference = plain.forward([_datum(seq)], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_torch()
    torch.testing.assert_close(alone, reference, rtol=0, atol=1e-4)  # the same function, other rounding
