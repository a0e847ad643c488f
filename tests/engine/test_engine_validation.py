"""Contract 7: bad input → ValueError naming the datum index and the field; nothing accumulated."""

import pytest
import torch
from tinker import types

from ember.engine import TorchEngine
from helpers.datums import random_sft_datums, sft_datum


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


def _rl(tokens, advantages=None, logprobs=None):
    n = len(tokens)
    return _datum(tokens, target_tokens=torch.tensor(tokens[1:] + [1]),
                  logprobs=torch.zeros(n) if logprobs is None else logprobs,
                  advantages=torch.ones(n) if advantages is None else advantages)


BATCH_CASES = [  # (bad datum index, the bad datum, expected message)
    (5, lambda: _datum([1, 2, -3], target_tokens=torch.tensor([2, 3, 4]), logprobs=torch.zeros(3),
                         advantages=torch.ones(3)), r"^datum 5: model_input token -3 at position 2 is outside"),
    (7, lambda: _datum([1, 2, 3], target_tokens=torch.tensor([2, 84, 4]), logprobs=torch.zeros(3),
                         advantages=torch.ones(3)),
     r"^datum 7: loss_fn_inputs\['target_tokens'\] has token id 84 at position 1, outside \[0, vocab_size=84\)"),
    (3, lambda: _rl([1, 2, 3], advantages=torch.tensor([0.0, float("nan"), 1.0])),
     r"^datum 3: loss_fn_inputs\['advantages'\] has a non-finite value nan at position 1"),
    (9, lambda: _rl([4, 5], logprobs=torch.tensor([0.0, float("-inf")])),
     r"^datum 9: loss_fn_inputs\['logprobs'\] has a non-finite value -inf at position 1"),
]


@pytest.mark.parametrize("bad,make,match", BATCH_CASES, ids=["ids", "targets", "advantages", "logprobs"])
def test_value_errors_in_a_large_request_name_the_first_bad_datum(engine, bad, make, match):
    """The value scans run over the whole request at once; the error is still the bad
    datum's own, and a later bad datum does not mask an earlier one."""
    datums = [_rl([1 + i % 7, 2, 3]) for i in range(12)]
    datums[bad] = make()
    datums[11] = _rl([1, 2, 3], advantages=torch.tensor([float("inf"), 0.0, 0.0]))  # also bad, but later
    with pytest.raises(ValueError, match=match):
        engine.forward_backward(datums, "importance_sampling")
    assert engine.status().accumulated_micro_batches == 0


def test_optional_weights_on_some_datums_are_scanned(engine):
    datums = [sft_datum([1, 2, 3, 4]) for _ in range(4)]
    datums.insert(2, _datum([1, 2, 3], target_tokens=torch.tensor([2, 3, 4]),
                            weights=torch.tensor([1.0, float("nan"), 1.0])))
    datums.append(_datum([1, 2], target_tokens=torch.tensor([2, 3])))  # no weights: ones
    with pytest.raises(ValueError, match=r"^datum 2: loss_fn_inputs\['weights'\] has a non-finite value nan"):
        engine.forward_backward(datums, "cross_entropy")
    del datums[2]
    engine.forward_backward(datums, "cross_entropy")  # the clean rest trains
    assert engine.status().accumulated_micro_batches > 0
    engine.clear_gradients()
