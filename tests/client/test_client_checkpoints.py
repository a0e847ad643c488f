"""Checkpoints through the in-process client: resume exactly, Adam reset, REST listings."""

from __future__ import annotations

import logging

import pytest
import tinker
import torch
from tinker import types

from helpers.datums import random_sft_datums, sft_datum

BASE = "ember-test/tiny-qwen3"
VOCAB = 84
PROBE = [5, 9, 14, 22, 31, 40, 7]
ADAM = types.AdamParams(learning_rate=1e-2)


def _probe(tc) -> torch.Tensor:
    return tc.forward([sft_datum(PROBE)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()


def _step(tc, batch) -> dict:
    tc.forward_backward(batch, "cross_entropy")
    return tc.optim_step(ADAM).result().metrics


def test_save_state_then_new_client_resumes_with_and_without_optimizer(make_client, tmp_path):
    batches = [random_sft_datums(3, VOCAB, seed=i) for i in range(3)]
    sc = make_client()
    tc = sc.create_lora_training_client(BASE, rank=4, seed=1).result()
    _step(tc, batches[0])
    _step(tc, batches[1])
    path = tc.save_state("step2").result().path
    assert path == f"tinker://{tc.model_id}/weights/step2"
    at_save = _probe(tc)
    assert _step(tc, batches[2])["step:max"] == 3.0
    continued = _probe(tc)
    # Same name again without overwrite → user failure (not a hang, not a retry loop).
    with pytest.raises(tinker.RequestFailedError) as err:
        tc.save_state("step2").result()
    assert err.value.category == types.RequestErrorCategory.User
    sc.close("success")  # last client of this data directory: the service shuts down

    sc2 = make_client(data_dir=tmp_path / "data")  # a fresh service over the same files
    resumed = sc2.create_training_client_from_state_with_optimizer(path).result()
    session = resumed.model_id.split(":")[0]
    assert resumed.model_id == f"{session}:train:0" and session not in tc.model_id
    assert resumed.get_info().lora_rank == 4 and resumed.get_info().model_data.model_name == BASE
    torch.testing.assert_close(_probe(resumed), at_save, rtol=0, atol=1e-6)
    assert _step(resumed, batches[2])["step:max"] == 3.0  # Adam state and step restored
    torch.testing.assert_close(_probe(resumed), continued, rtol=1e-5, atol=1e-6)

    fresh = sc2.create_training_client_from_state(path).result()
    assert fresh.model_id == f"{session}:train:1"
    torch.testing.assert_close(_probe(fresh), at_save, rtol=0, atol=1e-6)
    assert _step(fresh, batches[2])["step:max"] == 1.0  # Adam starts fresh
    assert (_probe(fresh) - continued).abs().max() > 1e-4


def test_deprecated_load_state_into_an_existing_client(make_client, caplog):
    sc = make_client()
    src = sc.create_lora_training_client(BASE, rank=4, seed=2).result()
    _step(src, random_sft_datums(2, VOCAB, seed=7))
    path = src.save_state("ck").result().path
    target = sc.create_lora_training_client(BASE, rank=4, seed=3).result()
    with caplog.at_level(logging.ERROR):
        resp = target.load_state_with_optimizer(path).result()
    assert resp.path == path and any("DEPRECATED" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(_probe(target), _probe(src), rtol=0, atol=1e-6)
    target.load_state(path).result()
    assert _step(target, random_sft_datums(2, VOCAB, seed=8))["step:max"] == 1.0
    other_rank = sc.create_lora_training_client(BASE, rank=8).result()
    with pytest.raises(tinker.RequestFailedError) as err:
        other_rank.load_state(path).result()
    assert err.value.category == types.RequestErrorCategory.User and "LoRA config" in err.value.message


def test_rest_client_listings_and_sampler_checkpoints(make_client):
    sc = make_client()
    tc = sc.create_lora_training_client(BASE, rank=4, user_metadata={"purpose": "test"}).result()
    _step(tc, random_sft_datums(2, VOCAB, seed=9))
    state = tc.save_state("s1").result().path
    sampler_path = tc.save_weights_for_sampler("w1").result().path
    assert sampler_path == f"tinker://{tc.model_id}/sampler_weights/w1"
    rc = sc.create_rest_client()
    run = rc.get_training_run(tc.model_id).result()
    assert run.is_lora and run.lora_rank == 4 and run.base_model == BASE and run.user_metadata == {"purpose": "test"}
    assert run.last_checkpoint.tinker_path == state and run.last_sampler_checkpoint.tinker_path == sampler_path
    ckpts = rc.list_checkpoints(tc.model_id).result().checkpoints
    assert {(c.checkpoint_id, c.checkpoint_type) for c in ckpts} == {("weights/s1", "training"), ("sampler_weights/w1", "sampler")}
    assert all(c.size_bytes and c.size_bytes > 0 for c in ckpts)
    runs = rc.list_training_runs(limit=1).result()
    assert runs.cursor.total_count == 1 and len(runs.training_runs) == 1
    info = rc.get_weights_info_by_tinker_path(sampler_path).result()
    assert info.base_model == BASE and info.is_lora and info.lora_rank == 4
    assert [m.model_name for m in rc.get_server_capabilities().result().supported_models] == [BASE]
    # A sampler from the saved sampler weights equals the trainer.
    sampler = sc.create_sampling_client(model_path=sampler_path).result()
    assert sampler.get_base_model() == BASE
    lp = sampler.compute_logprobs(types.ModelInput.from_ints(PROBE)).result()
    torch.testing.assert_close(torch.tensor(lp[1:]), _probe(tc), rtol=0, atol=1e-4)
    rc.delete_checkpoint_from_tinker_path(state).result()
    assert [c.tinker_path for c in rc.list_checkpoints(tc.model_id).result().checkpoints] == [sampler_path]


def test_resume_picks_the_optimizer_in_process(make_client):
    """Weights only: the requested optimizer, fresh. With state: the checkpoint's, and a
    config of another type is a user error naming both."""
    sc = make_client()
    tc = sc.create_lora_training_client(BASE, rank=4, seed=1).result()
    _step(tc, random_sft_datums(2, VOCAB, seed=0))
    path = tc.save_state("adam").result().path
    dimuon = sc.create_training_client_from_state(path, optimizer=types.DimuonOptimizerConfig()).result()
    dimuon.forward_backward(random_sft_datums(2, VOCAB, seed=1), "cross_entropy")
    assert dimuon.optim_step(types.DimuonParams(learning_rate=1e-2)).result().metrics["step:max"] == 1.0
    with pytest.raises(tinker.RequestFailedError, match="AdamParams.*dimuon"):
        dimuon.optim_step(ADAM).result()


def test_resuming_with_state_refuses_another_optimizer_type():
    from ember.service.api import UserError
    from ember.service.run_validation import resumed_optimizer as _resumed_optimizer

    saved = {"optimizer": "adamw"}  # the checkpoint's metadata (`CheckpointStore.meta`, ember_state.json)
    assert _resumed_optimizer(saved, True, None) == {"type": "adamw"}
    assert _resumed_optimizer(saved, False, {"type": "dimuon"}) == {"type": "dimuon", "version": 1}
    with pytest.raises(UserError, match="optimizer state is 'adamw', got a 'dimuon' config"):
        _resumed_optimizer(saved, True, {"type": "dimuon"})


def test_publish_unpublish_and_ttl_in_process(make_client):
    """The RestClient lifecycle calls in process: another owner of the same service samples a
    published checkpoint, and is refused like for a path never saved once unpublished."""
    alice = make_client(owner="alice")
    bob = make_client(service=alice.service, owner="bob")
    tc = alice.create_lora_training_client(BASE, rank=4, seed=1).result()
    _step(tc, random_sft_datums(2, VOCAB, seed=0))
    path = tc.save_weights_for_sampler("shared", ttl_seconds=3600, user_metadata={"k": "v"}).result().path
    rc, bob_rc = alice.create_rest_client(), bob.create_rest_client()
    (ck,) = rc.list_user_checkpoints().result().checkpoints
    assert (ck.public, ck.user_metadata, ck.expires_at is not None) == (False, {"k": "v"}, True)
    with pytest.raises(LookupError, match="not visible to this API key"):
        bob.create_sampling_client(model_path=path).result()
    rc.publish_checkpoint_from_tinker_path(path).result()
    assert rc.list_user_checkpoints().result().checkpoints[0].public
    prompt = types.ModelInput.from_ints(PROBE)
    assert bob.create_sampling_client(model_path=path).result().sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
    with pytest.raises(LookupError, match="not owned by this API key"):
        bob_rc.unpublish_checkpoint_from_tinker_path(path).result()
    rc.set_checkpoint_ttl_from_tinker_path(path, None).result()
    assert rc.list_user_checkpoints().result().checkpoints[0].expires_at is None
    with pytest.raises(ValueError, match="ttl_seconds must be between 1 and"):
        rc.set_checkpoint_ttl_from_tinker_path(path, -1).result()
    sampler = bob.create_sampling_client(model_path=path).result()
    rc.unpublish_checkpoint_from_tinker_path(path).result()
    with pytest.raises(LookupError, match="not visible to this API key"):
        bob.create_sampling_client(model_path=path).result()
    refused = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2))  # fails in .result(), as over HTTP
    with pytest.raises(LookupError, match="not visible to this API key"):
        refused.result()
