"""Typed requests (`ember.service.requests`): their own field checks, the sampler arguments a
`SampleRequest` carries, and one path for the keyword methods and `ServiceAPI.submit`."""

from __future__ import annotations

import dataclasses

import pytest
from tinker import types

from ember.sampling.base import SamplingRequest
from ember.service.api import UserError
from ember.service.requests import LoadWeightsRequest, SampleRequest, SaveWeightsForSamplerRequest

from .conftest import result

PROMPT = types.ModelInput.from_ints([1, 2, 3])
PARAMS = types.SamplingParams(max_tokens=2, seed=0)


@pytest.mark.parametrize("fields", [{}, {"model_id": "m", "seq_id": 1, "session_id": "s", "model_seq_id": 0}])
def test_load_weights_needs_exactly_one_addressing_mode(fields):
    with pytest.raises(UserError, match="model_id\\+seq_id or session_id\\+model_seq_id"):
        LoadWeightsRequest("tinker://r/weights/a", False, **fields).check_addressing()
    LoadWeightsRequest("tinker://r/weights/a", False, model_id="m", seq_id=1).check_addressing()


def test_save_weights_for_sampler_checks_name_its_fields():
    with pytest.raises(UserError, match="exactly one of path"):
        SaveWeightsForSamplerRequest("m", 1, "name", sampling_session_seq_id=0).check_target()
    with pytest.raises(UserError, match="kind='inflight' with path 'name'"):
        SaveWeightsForSamplerRequest("m", 1, "name", kind="inflight").check_kind()
    SaveWeightsForSamplerRequest("m", 1, sampling_session_seq_id=0, kind="inflight").check_kind()


def test_requests_are_frozen_and_keep_the_old_keyword_only_fields():
    req = SampleRequest("sampler", 1, PROMPT, 2, PARAMS, topk_sample_logprobs=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.num_samples = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        SampleRequest("sampler", 1, PROMPT, 2, PARAMS, False)  # include_prompt_logprobs is keyword-only


def test_sample_request_hands_the_backend_only_sampling_request_fields():
    calls = []
    req = SampleRequest("sampler", None, PROMPT, 2, PARAMS, include_prompt_logprobs=1, prompt_alt_tokens_k=2,
                        on_tokens=lambda *a: calls.append(a))
    args = req.sampler_arguments()
    assert set(args) <= {f.name for f in dataclasses.fields(SamplingRequest)}
    backend = SamplingRequest(**args)
    assert backend.include_prompt_logprobs is True and backend.prompt_alt_tokens_k == 2
    assert backend.on_tokens is req.on_tokens
    assert "on_tokens" not in SampleRequest("sampler", None, PROMPT, 2, PARAMS).sampler_arguments()


def test_keyword_methods_and_submit_go_one_way(make_service):
    """`sample(...)` builds the `SampleRequest` that `submit` takes: a resubmission by the
    other way is the same Submission (idempotent on (sampling_session_id, seq_id))."""
    svc = make_service()
    sid = svc.create_session("alice").session_id
    sampler = svc.create_sampling_session("alice", sid, 0, base_model="tiny").sampling_session_id
    first = svc.sample("alice", sampler, 1, PROMPT, 1, PARAMS)
    again = svc.submit("alice", SampleRequest(sampler, 1, PROMPT, 1, PARAMS))
    assert again == first
    assert len(result(svc, "alice", first).sequences) == 1
    with pytest.raises(UserError, match="expected a request of ember.service.requests, got str"):
        svc.submit("alice", "sample")  # type: ignore[arg-type]
