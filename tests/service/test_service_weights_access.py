"""Weights access tokens: another API key loads a private checkpoint's training state only
with a token its owner made for that checkpoint (`LoadWeightsRequest.weights_access_token`)."""

from __future__ import annotations

import pytest
import torch
from tinker import types

from ember.service import NotFoundError, UserError
from helpers.datums import random_sft_datums, sft_datum

from .conftest import new_run, result, wait

PROBE = [5, 9, 14, 22, 31, 40, 7]


def probe(svc, owner, model_id, seq_id):
    out = svc.forward_backward(owner, model_id, seq_id, [sft_datum(PROBE)], "cross_entropy", forward_only=True)
    return result(svc, owner, out).loss_fn_outputs[0]["logprobs"].to_torch()


@pytest.fixture
def trained(make_service):
    """alice's run after one step, saved as `weights/shared` and `weights/other` (its next seq_id: 6)."""
    svc = make_service()
    _, run = new_run(svc, "alice")
    result(svc, "alice", svc.forward_backward("alice", run, 1, random_sft_datums(3, 84), "cross_entropy"))
    result(svc, "alice", svc.optim_step("alice", run, 2, types.AdamParams(learning_rate=1e-2)))
    path = result(svc, "alice", svc.save_weights("alice", run, 3, "shared")).path
    result(svc, "alice", svc.save_weights("alice", run, 4, "other"))
    return svc, run, path, probe(svc, "alice", run, 5)


def bob_loads(svc, path, token=None, seq=0):
    sid = svc.create_session("bob").session_id
    return wait(svc, "bob", svc.load_weights("bob", path, False, session_id=sid, model_seq_id=seq,
                                             weights_access_token=token))


def test_a_token_lets_another_key_load_exactly_that_checkpoint(trained):
    svc, run, path, alice_lp = trained
    token, expires = svc.create_weights_access_token("alice", run, "weights/shared")
    loaded = bob_loads(svc, path, token)
    assert loaded.status == "complete", loaded.error
    torch.testing.assert_close(probe(svc, "bob", loaded.result.model_id, 1), alice_lp, rtol=1e-5, atol=0)
    # into an existing run of bob's too (load_state: an ordered op of that run)
    _, bobs = new_run(svc, "bob")
    into = wait(svc, "bob", svc.load_weights("bob", path, False, model_id=bobs, seq_id=1, weights_access_token=token))
    assert into.status == "complete", into.error
    torch.testing.assert_close(probe(svc, "bob", bobs, 2), alice_lp, rtol=1e-5, atol=0)


def test_without_a_valid_token_the_load_is_refused_saying_why(trained):
    svc, run, path, _ = trained
    assert "not found (or not visible to this API key)" in bob_loads(svc, path).error
    other_token, _ = svc.create_weights_access_token("alice", run, "weights/other")
    for token in ("garbage", other_token, other_token[:-2] + "xx"):
        refused = bob_loads(svc, path, token)
        assert refused.status == "failed" and refused.category == "user"
        assert f"weights_access_token does not grant access to {path!r}" in refused.error


def test_overwriting_the_checkpoint_revokes_its_tokens(trained):
    svc, run, path, _ = trained
    token, _ = svc.create_weights_access_token("alice", run, "weights/shared")
    result(svc, "alice", svc.save_weights("alice", run, 6, "shared", overwrite=True))
    assert "does not grant access" in bob_loads(svc, path, token).error


def test_a_published_checkpoint_needs_no_token(trained):
    svc, run, path, _ = trained
    svc.set_checkpoint_public("alice", run, "weights/shared", True)
    assert bob_loads(svc, path).status == "complete"


def test_only_the_owner_makes_a_token_and_only_for_training_state(trained):
    svc, run, _, _ = trained
    with pytest.raises(NotFoundError):
        svc.create_weights_access_token("bob", run, "weights/shared")
    result(svc, "alice", svc.save_weights_for_sampler("alice", run, 6, "s"))
    with pytest.raises(UserError, match="training state"):
        svc.create_weights_access_token("alice", run, "sampler_weights/s")
    with pytest.raises(UserError, match="ttl_seconds"):
        svc.create_weights_access_token("alice", run, "weights/shared", ttl_seconds=-1)
