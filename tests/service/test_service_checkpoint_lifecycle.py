"""Checkpoint lifecycle in the service: publish / unpublish (another owner reads a published
checkpoint by path, and only then), TTLs (expired = gone everywhere, then swept),
user_metadata bounds and overwrite; every refusal of a path answers like a path never saved."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from tinker import types

from helpers.clock import ManualClock
from helpers.datums import random_sft_datums
from helpers.server import wait_until
from ember.service import NotFoundError, UserError

from .conftest import new_run, result, wait

User = types.RequestErrorCategory.User
PROBE = [3, 9, 27, 81, 4]
SAMPLE = dict(prompt=types.ModelInput.from_ints(PROBE), num_samples=1,
              sampling_params=types.SamplingParams(max_tokens=1), include_prompt_logprobs=True)


def _trained(svc, owner="alice"):
    """A run after one step, saved as training state "st" and sampler weights "sw"."""
    sid, mid = new_run(svc, owner)
    result(svc, owner, svc.forward_backward(owner, mid, 1, random_sft_datums(2, 84, seed=5), "cross_entropy"))
    result(svc, owner, svc.optim_step(owner, mid, 2, types.AdamParams(learning_rate=5e-2)))
    state = result(svc, owner, svc.save_weights(owner, mid, 3, "st")).path
    sampler = result(svc, owner, svc.save_weights_for_sampler(owner, mid, 4, "sw")).path
    return sid, mid, state, sampler


def _prompt_lp(svc, owner, sampler_id, seq):
    return torch.tensor(result(svc, owner, svc.sample(owner, sampler_id, seq, **SAMPLE)).prompt_logprobs[1:])


def _ids(path: str) -> tuple[str, str]:
    run_id, _, checkpoint_id = path.removeprefix("tinker://").partition("/")
    return run_id, checkpoint_id


def _refused_message(exc_info, path: str) -> str:
    return str(exc_info.value).replace(path, "<path>")


def test_published_checkpoint_is_readable_by_another_owner_until_unpublished(make_service):
    svc = make_service()
    _, _, state, sampler = _trained(svc)
    owner_lp = _prompt_lp(svc, "alice", svc.create_sampling_session(
        "alice", svc.create_session("alice").session_id, 0, model_path=sampler).sampling_session_id, 0)
    bob = svc.create_session("bob").session_id
    never = state.replace("/st", "/never-saved")
    with pytest.raises(NotFoundError) as foreign:
        svc.create_sampling_session("bob", bob, 0, model_path=sampler)
    with pytest.raises(NotFoundError) as missing:
        svc.create_sampling_session("bob", bob, 0, model_path=never)
    assert _refused_message(foreign, sampler) == _refused_message(missing, never)  # existence not revealed

    svc.set_checkpoint_public("alice", *_ids(sampler), True)
    svc.set_checkpoint_public("alice", *_ids(state), True)
    svc.set_checkpoint_public("alice", *_ids(state), True)  # idempotent
    listed = {c.tinker_path: c.public for c in svc.list_user_checkpoints("alice").checkpoints}
    assert listed == {state: True, sampler: True}
    # Bob samples from it (same weights as alice's sampler), loads it, reads its info.
    bob_sampler = svc.create_sampling_session("bob", bob, 1, model_path=sampler).sampling_session_id
    torch.testing.assert_close(_prompt_lp(svc, "bob", bob_sampler, 0), owner_lp, rtol=0, atol=1e-6)
    loaded = result(svc, "bob", svc.load_weights("bob", state, True, session_id=bob, model_seq_id=0))
    assert loaded.path == state and loaded.model_id == f"{bob}:train:0"
    assert svc.get_weights_info("bob", state).lora_rank == 4
    # ... but never lists alice's things, nor changes them.
    assert svc.list_user_checkpoints("bob").checkpoints == []
    with pytest.raises(NotFoundError):
        svc.list_checkpoints("bob", _ids(state)[0])
    for call in (lambda: svc.set_checkpoint_public("bob", *_ids(state), False),
                 lambda: svc.set_checkpoint_ttl("bob", *_ids(state), 60),
                 lambda: svc.delete_checkpoint("bob", *_ids(state))):
        with pytest.raises(NotFoundError, match="not owned by this API key"):
            call()

    svc.set_checkpoint_public("alice", *_ids(sampler), False)
    svc.set_checkpoint_public("alice", *_ids(state), False)
    assert {c.public for c in svc.list_user_checkpoints("alice").checkpoints} == {False}
    with pytest.raises(NotFoundError) as again:
        svc.create_sampling_session("bob", bob, 2, model_path=sampler)
    assert _refused_message(again, sampler) == _refused_message(missing, never)
    with pytest.raises(NotFoundError, match="not visible to this API key"):  # the loaded sampler stops too
        svc.sample("bob", bob_sampler, 1, **SAMPLE)
    st = wait(svc, "bob", svc.load_weights("bob", state, False, session_id=bob, model_seq_id=1))
    assert st.category == User and "not visible to this API key" in st.error
    with pytest.raises(NotFoundError):
        svc.get_weights_info("bob", state)
    assert svc.get_weights_info("alice", state).lora_rank == 4  # the owner always reads


@pytest.mark.slow
def test_expired_checkpoint_is_gone_everywhere_then_swept(make_service, database_url):
    clock = ManualClock()
    svc = make_service(database_url=database_url, clock=clock)
    sid, mid, state, _ = _trained(svc)
    short = result(svc, "alice", svc.save_weights("alice", mid, 5, "short", ttl_seconds=1)).path
    listed = {c.tinker_path: c for c in svc.list_checkpoints("alice", mid).checkpoints}
    assert listed[state].expires_at is None
    assert abs((listed[short].expires_at - listed[short].time).total_seconds() - 1) < 0.05
    sampler_id = svc.create_sampling_session("alice", sid, 0, model_path=short).sampling_session_id
    svc.set_checkpoint_public("alice", *_ids(short), True)
    directory = Path(svc.checkpoints.row(short).directory)
    clock.advance(1.1)
    # Expired, not yet swept: files still there, but every call answers 404 (user).
    assert directory.is_dir()
    assert short not in {c.tinker_path for c in svc.list_checkpoints("alice", mid).checkpoints}
    assert short not in {c.tinker_path for c in svc.list_user_checkpoints("alice").checkpoints}
    assert svc.list_user_checkpoints("alice").cursor.total_count == 2
    for owner in ("alice", "bob"):
        with pytest.raises(NotFoundError):
            svc.get_weights_info(owner, short)
    for call in (lambda: svc.delete_checkpoint("alice", *_ids(short)),
                 lambda: svc.set_checkpoint_ttl("alice", *_ids(short), 3600),
                 lambda: svc.set_checkpoint_public("alice", *_ids(short), True),
                 lambda: svc.create_sampling_session("alice", sid, 1, model_path=short)):
        with pytest.raises(NotFoundError):
            call()
    with pytest.raises(NotFoundError, match="not found"):
        svc.sample("alice", sampler_id, 0, **SAMPLE)
    st = wait(svc, "alice", svc.load_weights("alice", short, False, model_id=mid, seq_id=6))
    assert st.category == User and "not found" in st.error
    # Saving the name again is not an overwrite of a live checkpoint.
    assert result(svc, "alice", svc.save_weights("alice", mid, 7, "short", ttl_seconds=1)).path == short
    clock.advance(1.1)
    assert svc.sweep_expired_checkpoints() == 1
    assert svc.checkpoints.row(short) is None and not directory.exists()
    assert not any(Path(svc.config.data_dir, "checkpoints").rglob("short*"))
    assert [c.tinker_path for c in svc.list_checkpoints("alice", mid).checkpoints] == [state, state.replace(
        "/weights/st", "/sampler_weights/sw")]


def test_set_ttl_and_clear_it_and_hostile_values(make_service):
    svc = make_service()
    _, mid, state, _ = _trained(svc)
    svc.set_checkpoint_ttl("alice", *_ids(state), 3600)
    (ck,) = [c for c in svc.list_user_checkpoints("alice").checkpoints if c.tinker_path == state]
    assert abs(ck.expires_at.timestamp() - (time.time() + 3600)) < 5
    svc.set_checkpoint_ttl("alice", *_ids(state), None)
    (ck,) = [c for c in svc.list_user_checkpoints("alice").checkpoints if c.tinker_path == state]
    assert ck.expires_at is None
    for bad in (0, -1, 10**12, 1.5, True, "60"):
        with pytest.raises(UserError, match="ttl_seconds must be"):
            svc.set_checkpoint_ttl("alice", *_ids(state), bad)
    for run_id, checkpoint_id in ((_ids(state)[0], "st"), (_ids(state)[0], "weights/../x"), ("a/b", "weights/st"),
                                  (_ids(state)[0], "weights/st/more")):
        with pytest.raises(UserError):
            svc.set_checkpoint_public("alice", run_id, checkpoint_id, True)
    # On a save: refused as a user failure in the run's order; the next op runs at once.
    bad = wait(svc, "alice", svc.save_weights("alice", mid, 5, "neg", ttl_seconds=-5))
    assert bad.category == User and "ttl_seconds must be between 1 and 315360000" in bad.error
    start = time.monotonic()
    result(svc, "alice", svc.save_weights_for_sampler("alice", mid, 6, "ok", ttl_seconds=3600))
    assert time.monotonic() - start < 3  # no wait for a skipped seq_id


def test_user_metadata_and_overwrite_are_kept_and_bounded(make_service):
    svc = make_service()
    _, mid, state, _ = _trained(svc)
    svc.set_checkpoint_public("alice", *_ids(state), True)
    dup = wait(svc, "alice", svc.save_weights("alice", mid, 5, "st", user_metadata={"a": "1"}))
    assert dup.category == User and "already exists; pass overwrite=True" in dup.error
    (ck,) = [c for c in svc.list_user_checkpoints("alice").checkpoints if c.tinker_path == state]
    assert ck.user_metadata is None and ck.public  # untouched by the refused save
    meta = {"step": "1", "note": "é" * 100}
    assert result(svc, "alice", svc.save_weights("alice", mid, 6, "st", overwrite=True, user_metadata=meta,
                                                 ttl_seconds=7200)).path == state
    (ck,) = [c for c in svc.list_user_checkpoints("alice").checkpoints if c.tinker_path == state]
    assert ck.user_metadata == meta and ck.public is False and ck.expires_at is not None  # a new checkpoint
    cases = [
        ({f"k{i}": "v" for i in range(65)}, "65 entries; the limit is 64"),
        ({"k" * 129: "v"}, "has 129 characters; expected 1 to 128"),
        ({"": "v"}, "has 0 characters"),
        ({"k": "v" * 4097}, "has 4097 characters; the limit is 4096"),
        ({"k": 1}, "keys and values must be strings"),
        (["k"], "user_metadata must be an object of strings"),
    ]
    for seq, (bad, message) in enumerate(cases, start=7):
        st = wait(svc, "alice", svc.save_weights_for_sampler("alice", mid, seq, "m", user_metadata=bad))
        assert st.category == User and message in st.error, st.error
    assert "m" not in {c.tinker_path.rsplit("/", 1)[1] for c in svc.list_user_checkpoints("alice").checkpoints}


def test_the_housekeeping_thread_sweeps_at_its_interval_and_state_survives_a_restart(make_service, tmp_path,
                                                                                     database_url):
    data = tmp_path / "data"
    svc = make_service(data_dir=data, database_url=database_url, checkpoints={"sweep_interval_s": 0.2})
    _, mid, state, sampler = _trained(svc)
    svc.set_checkpoint_public("alice", *_ids(state), True)
    svc.set_checkpoint_ttl("alice", *_ids(sampler), 3600)
    short = result(svc, "alice", svc.save_weights("alice", mid, 5, "short", ttl_seconds=1)).path
    directory = Path(svc.checkpoints.row(short).directory)
    wait_until(lambda: not directory.exists(), 10, interval=0.1, message=f"{directory} to be removed")
    assert svc.checkpoints.row(short) is None
    before = {c.tinker_path: (c.public, c.expires_at) for c in svc.list_user_checkpoints("alice").checkpoints}
    svc.close()
    again = make_service(data_dir=data, database_url=database_url)
    after = {c.tinker_path: (c.public, c.expires_at) for c in again.list_user_checkpoints("alice").checkpoints}
    assert after == before and after[state][0] is True and after[sampler][1] is not None
    assert again.get_weights_info("bob", state).lora_rank == 4


@pytest.mark.parametrize("bad, message", [
    ({"sweep_interval_s": 0}, "checkpoints.sweep_interval_s must be > 0, got 0"),
    ({"max_ttl_s": 0}, "checkpoints.max_ttl_s must be an integer >= 1, got 0"),
    ({"max_metadata_entries": 1.5}, "checkpoints.max_metadata_entries must be an integer >= 1, got 1.5"),
])
def test_checkpoint_config_is_validated(tmp_path, bad, message):
    from ember.service import ServiceConfig

    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        ServiceConfig(data_dir=tmp_path, checkpoints=bad)
