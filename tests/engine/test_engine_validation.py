"""Contract 7: bad input → ValueError naming the datum index and the field; nothing accumulated."""

import pytest
import torch
from tinker import types

from ember.engine import TorchEngine
from ember.engine.testing import random_sft_datums, sft_datum


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return TorchEngine.from_pretrained(tiny_model_dir)


def _datum(tokens, **inputs):
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


GOOD = sft_datum([1, 2, 3, 4])
CASES = [
    ("token_out_of_vocab", [GOOD, sft_datum([1, 2, 500, 4])], "cross_entropy", r"datum 1: model_input token 500"),
    ("target_out_of_vocab", [GOOD, _datum([1, 2], target_tokens=torch.tensor([3, 99]), weights=torch.ones(2))],
     "cross_entropy", r"datum 1.*target_tokens"),
    ("length_mismatch", [_datum([1, 2, 3], target_tokens=torch.tensor([3, 4]), weights=torch.ones(2))],
     "cross_entropy", r"datum 0.*target_tokens"),
    ("weights_mismatch", [GOOD, _datum([1, 2, 3], target_tokens=torch.tensor([3, 4, 5]), weights=torch.ones(2))],
     "cross_entropy", r"datum 1.*weights"),
    ("missing_advantages", [_datum([1, 2], target_tokens=torch.tensor([3, 4]), logprobs=torch.zeros(2))],
     "ppo", r"datum 0.*advantages"),
    ("extra_input", [_datum([1, 2], target_tokens=torch.tensor([3, 4]), weights=torch.ones(2), bogus=torch.ones(2))],
     "cross_entropy", r"datum 0.*bogus"),
    ("float_targets", [_datum([1, 2], target_tokens=torch.tensor([3.0, 4.0]), weights=torch.ones(2))],
     "cross_entropy", r"datum 0.*target_tokens"),
    ("empty_input", [_datum([], target_tokens=torch.tensor([], dtype=torch.int64))], "cross_entropy", r"datum 0"),
    ("unknown_loss", [GOOD], "bogus_loss", r"bogus_loss"),
]


@pytest.mark.parametrize("name,datums,loss_fn,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_clear_error(engine, name, datums, loss_fn, match):
    with pytest.raises(ValueError, match=match):
        engine.forward_backward(datums, loss_fn)
    assert engine.status().accumulated_micro_batches == 0
    assert all(p.grad is None for p in engine.state_tensors().values())


def test_engine_keeps_working_after_errors(engine):
    with pytest.raises(ValueError):
        engine.forward_backward([sft_datum([1, 999])], "cross_entropy")
    out = engine.forward_backward(random_sft_datums(2, vocab=84), "cross_entropy")
    assert out.metrics["loss:sum"] > 0
    engine.clear_gradients()


def test_unknown_config_key(engine):
    with pytest.raises(ValueError, match="clip_low"):
        engine.forward([GOOD], "cross_entropy", {"clip_low": 0.5})
