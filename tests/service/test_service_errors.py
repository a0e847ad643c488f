"""Whose fault a failure is: only a `UserError` (raised where the caller's input is validated)
is `user`; any other exception, a ValueError from a bug included, is `server`, and its
traceback is logged. A fail point plants such a bug-like ValueError (numpy's words on
mismatched shapes) where a training op and a sample request run."""

from __future__ import annotations

import logging

import pytest
from tinker import types

from ember import failpoints
from ember.errors import UserError
from ember.service import UserError as ServiceUserError
from helpers.datums import sft_datum

from .conftest import new_run, wait

BUG = "operands could not be broadcast together"


@pytest.fixture(autouse=True)
def disarmed():
    yield
    failpoints.disarm()


def tracebacks(caplog, logger: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger and r.levelno >= logging.ERROR and r.exc_info
            and BUG in str(r.exc_info[1])]


def test_the_service_and_the_engine_raise_one_user_error():
    assert ServiceUserError is UserError and issubclass(UserError, ValueError)


def test_a_bug_like_value_error_in_a_training_op_is_a_server_error_with_its_traceback_logged(make_service, caplog):
    svc = make_service()
    _, run = new_run(svc)
    failpoints.arm("run.op", "valueerror", times=1)
    with caplog.at_level(logging.ERROR, logger="ember.service.runs"):
        state = wait(svc, "alice", svc.forward_backward("alice", run, 1, [sft_datum([1, 2, 3], [4, 5])],
                                                        "cross_entropy"))
    assert (state.status, state.category) == ("failed", types.RequestErrorCategory.Server), state
    assert state.error.startswith("internal error (ValueError): " + BUG), state.error
    assert len(tracebacks(caplog, "ember.service.runs")) == 1
    # bad input at the same place is still the caller's, in the validation's own words
    bad = sft_datum([1, 2, 3], [4, 5])
    bad.loss_fn_inputs.pop("weights")
    bad.loss_fn_inputs["target_tokens"] = types.TensorData(data=[1], dtype="int64", shape=[1])
    refused = wait(svc, "alice", svc.forward_backward("alice", run, 2, [bad], "cross_entropy"))
    assert (refused.status, refused.category) == ("failed", types.RequestErrorCategory.User), refused
    assert refused.error.startswith("datum 0"), refused.error


def test_a_bug_like_value_error_in_a_sample_request_is_a_server_error_with_its_traceback_logged(make_service,
                                                                                                 caplog):
    svc = make_service()
    sid = svc.create_session("alice").session_id
    sampler = svc.create_sampling_session("alice", sid, 0, base_model="tiny").sampling_session_id
    params = types.SamplingParams(max_tokens=2, temperature=0.0)
    failpoints.arm("sampler.submit", "valueerror", times=1)
    with caplog.at_level(logging.ERROR, logger="ember.service.samplers"):
        state = wait(svc, "alice", svc.sample("alice", sampler, 0, types.ModelInput.from_ints([5, 6, 7]), 1, params))
    assert (state.status, state.category) == ("failed", types.RequestErrorCategory.Server), state
    assert state.error.startswith("internal error (ValueError): " + BUG), state.error
    assert len(tracebacks(caplog, "ember.service.samplers")) == 1
    refused = wait(svc, "alice", svc.sample("alice", sampler, 1, types.ModelInput.from_ints([5, 6, 7]), 1,
                                            types.SamplingParams(max_tokens=2, top_p=0.0)))
    assert (refused.status, refused.category) == ("failed", types.RequestErrorCategory.User), refused
    assert refused.error == "sample request: sampling_params.top_p: expected a number in (0, 1], got 0.0"
    ok = wait(svc, "alice", svc.sample("alice", sampler, 2, types.ModelInput.from_ints([5, 6, 7]), 1, params))
    assert ok.status == "complete", ok
