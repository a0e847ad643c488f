"""Service semantics with real engines: ordering, idempotency, errors, visibility, checkpoints."""

from __future__ import annotations


import pytest
import torch
from tinker import types

from helpers.clock import ManualClock
from helpers.datums import random_sft_datums, sft_datum
from helpers.server import wait_until
from ember.service import NotFoundError, SessionGoneError, UserError

from .conftest import lane_drained, new_run, result, wait

User = types.RequestErrorCategory.User
Server = types.RequestErrorCategory.Server
VOCAB = 84
ADAM = types.AdamParams(learning_rate=1e-2)


def _logprobs(out: types.ForwardBackwardOutput) -> list[torch.Tensor]:
    return [o["logprobs"].to_torch() for o in out.loss_fn_outputs]


def test_ops_run_in_seq_order_when_submitted_out_of_order(make_service):
    svc = make_service()
    _, mid = new_run(svc)
    data = random_sft_datums(3, VOCAB, seed=1)
    probe = random_sft_datums(2, VOCAB, seed=2)
    # Arrival order 3, 2, 1: forward (3) must see the update of optim_step (2), which
    # must see the gradient of forward_backward (1).
    s3 = svc.forward_backward("alice", mid, 3, probe, "cross_entropy", forward_only=True)
    s2 = svc.optim_step("alice", mid, 2, ADAM)
    lane_drained(svc, "alice", mid)  # had the sequencer released 2 (or 3), it would have run by now
    assert svc.retrieve("alice", s2.request_id).status == "pending"
    assert svc.retrieve("alice", s3.request_id).status == "pending"
    s1 = svc.forward_backward("alice", mid, 1, data, "cross_entropy")
    before = result(svc, "alice", s1)
    step = result(svc, "alice", s2)
    after = result(svc, "alice", s3)
    assert step.metrics["grad_norm:mean"] > 0  # the gradient of seq 1 was there
    assert step.metrics["step:max"] == 1.0
    s4 = svc.forward_backward("alice", mid, 4, data, "cross_entropy", forward_only=True)
    # Loss on `data` went down after the step: seq 4 ran after seq 2.
    assert result(svc, "alice", s4).metrics["loss:sum"] < before.metrics["loss:sum"]
    assert after.metrics["loss:sum"] > 0


def test_resubmission_of_the_same_seq_id_is_idempotent(make_service):
    svc = make_service()
    _, mid = new_run(svc)
    data = random_sft_datums(2, VOCAB, seed=3)
    a = svc.forward_backward("alice", mid, 1, data, "cross_entropy")
    b = svc.forward_backward("alice", mid, 1, data, "cross_entropy")  # e.g. a retry after a timeout
    assert a == b
    s1 = svc.optim_step("alice", mid, 2, ADAM)
    s2 = svc.optim_step("alice", mid, 2, ADAM)
    assert s1.request_id == s2.request_id
    assert result(svc, "alice", s1).metrics["step:max"] == 1.0
    # Executed once: the next step is step 2, and it has no gradient left (norm 0).
    nxt = result(svc, "alice", svc.optim_step("alice", mid, 3, ADAM))
    assert nxt.metrics["step:max"] == 2.0 and nxt.metrics["grad_norm:mean"] == 0.0
    sid = svc.get_info("alice", mid).model_id.split(":")[0]
    c1 = svc.create_model("alice", sid, 0, "tiny", types.LoraConfig(rank=4))
    assert wait(svc, "alice", c1).result.model_id == mid  # same creation future


def test_gap_timeout_skips_a_missing_seq_id_and_a_late_one_fails(make_service):
    svc = make_service(seq_gap_timeout_s=0.3)
    _, mid = new_run(svc)
    data = random_sft_datums(2, VOCAB, seed=4)
    # seq 1 was "rejected at the HTTP layer" and never arrives.
    s2 = svc.forward_backward("alice", mid, 2, data, "cross_entropy")
    s3 = svc.optim_step("alice", mid, 3, ADAM)
    assert result(svc, "alice", s3).metrics["grad_norm:mean"] > 0
    assert wait(svc, "alice", s2).status == "complete"
    late = wait(svc, "alice", svc.forward_backward("alice", mid, 1, data, "cross_entropy"))
    assert late.status == "failed" and late.category == Server
    assert "arrived after it was skipped" in late.error


def test_a_request_refused_before_queueing_takes_its_turn_and_leaves_no_gap(make_service):
    """A forward_backward over a limit is refused before it is queued; it still takes its
    seq_id's place, so the next request runs at once instead of waiting out the gap timeout
    (600 s here: a stall would fail `result`'s 60 s wait)."""
    from ember.service.limits import Limits

    svc = make_service(seq_gap_timeout_s=600, limits=Limits(max_datums_per_request=2))
    _, mid = new_run(svc)
    data = random_sft_datums(3, VOCAB, seed=11)
    refused = wait(svc, "alice", svc.forward_backward("alice", mid, 1, data, "cross_entropy"))
    assert refused.status == "failed" and refused.category == User
    assert "data has 3 datums" in refused.error and "max_datums_per_request=2" in refused.error
    assert result(svc, "alice", svc.forward_backward("alice", mid, 2, data[:2], "cross_entropy"), timeout=60)
    again = wait(svc, "alice", svc.forward_backward("alice", mid, 1, data, "cross_entropy"))  # a retry: refused again
    assert again.status == "failed" and "max_datums_per_request" in again.error
    # another owner's refusal under the same seq_id takes nobody's turn in alice's run
    other = wait(svc, "mallory", svc.forward_backward("mallory", mid, 3, data, "cross_entropy"))
    assert other.status == "failed" and other.category == User
    assert result(svc, "alice", svc.optim_step("alice", mid, 3, ADAM), timeout=60).metrics["step:max"] == 1.0


def test_bad_inputs_fail_with_user_category_and_the_service_keeps_serving(make_service):
    svc = make_service()
    sid, mid = new_run(svc)
    good = random_sft_datums(2, VOCAB, seed=5)
    oov = [good[0], sft_datum([1, 2, VOCAB + 7, 3])]
    cases = [
        svc.forward_backward("alice", mid, 1, good, "no_such_loss"),
        svc.forward_backward("alice", mid, 2, oov, "cross_entropy"),
        svc.forward_backward("alice", mid, 3, good, "ppo"),  # missing logprobs/advantages
        svc.forward_backward("alice", "sess-nope:train:0", 1, good, "cross_entropy"),
        svc.create_model("alice", sid, 1, "no-such-model", types.LoraConfig(rank=4)),
        svc.create_model("alice", sid, 2, "tiny", types.LoraConfig(rank=0)),
        svc.save_weights("alice", mid, 4, "../escape"),
        svc.save_weights("alice", mid, 5, "/abs/path"),
        svc.save_weights("alice", mid, 6, "a/b"),
        svc.save_weights("alice", mid, 7, "bad name!"),
        svc.load_weights("alice", "tinker://nope/weights/x", True, model_id=mid, seq_id=8),
        svc.optim_step("alice", mid, -1, ADAM),
    ]
    states = [wait(svc, "alice", s) for s in cases]
    for st in states:
        assert st.status == "failed" and st.category == User, (st.request_type, st.error)
    assert "no_such_loss" in states[0].error
    assert "datum 1" in states[1].error  # the engine names the datum index
    assert "no-such-model" in states[4].error
    # Duplicate checkpoint name without overwrite → user; with overwrite → fine.
    assert result(svc, "alice", svc.save_weights("alice", mid, 9, "ck"))
    dup = wait(svc, "alice", svc.save_weights("alice", mid, 10, "ck"))
    assert dup.category == User and "already exists" in dup.error
    assert result(svc, "alice", svc.save_weights("alice", mid, 11, "ck", overwrite=True))
    # Non-finite gradient: optim_step refuses it (user), weights untouched, then training goes on.
    huge = [sft_datum([5, 6, 7, 8], [3e38, 3e38, 3e38])]
    result(svc, "alice", svc.forward_backward("alice", mid, 12, huge, "cross_entropy"))
    nf = wait(svc, "alice", svc.optim_step("alice", mid, 13, ADAM))
    assert nf.category == User and "non-finite" in nf.error
    out = result(svc, "alice", svc.forward_backward("alice", mid, 14, good, "cross_entropy"))
    assert torch.isfinite(torch.tensor(out.metrics["loss:sum"]))
    assert result(svc, "alice", svc.optim_step("alice", mid, 15, ADAM)).metrics["step:max"] == 1.0


def test_visibility_is_by_owner(make_service):
    svc = make_service()
    sid, mid = new_run(svc, owner="alice")
    path = result(svc, "alice", svc.save_weights("alice", mid, 1, "mine")).path
    fb = svc.forward_backward("alice", mid, 2, random_sft_datums(1, VOCAB), "cross_entropy")
    wait(svc, "alice", fb)
    bob_sid = svc.create_session("bob").session_id
    for call in (
        lambda: svc.get_info("bob", mid),
        lambda: svc.get_training_run("bob", mid),
        lambda: svc.list_checkpoints("bob", mid),
        lambda: svc.get_weights_info("bob", path),
        lambda: svc.retrieve("bob", fb.request_id),
        lambda: svc.get_session("bob", sid),
        lambda: svc.heartbeat("bob", sid),
    ):
        with pytest.raises(NotFoundError):
            call()
    assert svc.list_training_runs("bob").training_runs == []
    assert svc.list_user_checkpoints("bob").checkpoints == []
    # Bob cannot train alice's run, load her checkpoint, or sample from it.
    st = wait(svc, "bob", svc.optim_step("bob", mid, 3, ADAM))
    assert st.category == User and "unknown model_id" in st.error
    st = wait(svc, "bob", svc.load_weights("bob", path, True, session_id=bob_sid, model_seq_id=0))
    assert st.category == User and "not found" in st.error
    with pytest.raises(UserError):
        svc.create_sampling_session("bob", bob_sid, 0, model_path=path)
    # Alice sees all of it.
    assert [r.training_run_id for r in svc.list_training_runs("alice").training_runs] == [mid]
    assert svc.get_weights_info("alice", path).lora_rank == 4


def test_sessions_heartbeat_finish_and_expiry(make_service, caplog):
    # A manual clock: the session is silent for 0.7 s of its time however slow the machine is.
    now = [1_000_000.0]
    svc = make_service(sessions={"heartbeat_timeout_s": 0.5}, clock=lambda: now[0])
    sid, mid = new_run(svc)
    result(svc, "alice", svc.forward_backward("alice", mid, 1, random_sft_datums(2, VOCAB), "cross_entropy"))
    result(svc, "alice", svc.optim_step("alice", mid, 2, ADAM))
    trained = _logprobs(svc, "alice", mid, 3)
    svc.heartbeat("alice", sid)
    now[0] += 0.4
    svc.heartbeat("alice", sid)  # a heartbeat keeps it: 0.8 s old, 0.4 s since the last one
    now[0] += 0.4
    assert svc.expire_sessions() == [] and svc.get_session("alice", sid).training_run_ids == [mid]
    assert list(svc.owner_state("alice")["queue_depths"]) == [mid]  # loaded
    now[0] += 0.7
    with caplog.at_level("INFO", logger="ember.service"):
        svc.expire_sessions()  # returns [] when the housekeeping thread expired it first; either way:
        with pytest.raises(SessionGoneError, match="no heartbeat for more than 0.5 s"):
            svc.heartbeat("alice", sid)
        assert svc.owner_state("alice")["queue_depths"] == {}  # unloaded: the runs quota is free at once
        saved = f"tinker://{mid}/weights/session-end"
        wait_until(lambda: saved in [c.tinker_path for c in svc.list_checkpoints("alice", mid).checkpoints],
                   timeout=60, interval=0.05,  # saved on the run's lane, after what was queued
                   message="the run's save when its session expired")
        st = wait(svc, "alice", svc.optim_step("alice", mid, 4, ADAM))
        assert st.category == Server and "not loaded" in st.error and saved in st.error  # saved before unloading
    assert f"session {sid} expired (no heartbeat" in caplog.text and f"saved as {saved}" in caplog.text
    # ... with its optimizer: resumed, it continues where it was
    sid3 = svc.create_session("alice").session_id
    resumed = result(svc, "alice", svc.load_weights("alice", saved, True, session_id=sid3, model_seq_id=0)).model_id
    torch.testing.assert_close(_logprobs(svc, "alice", resumed, 1), trained, rtol=1e-5, atol=0)
    sid2 = svc.create_session("alice").session_id
    svc.finish_session("alice", sid2, "success")
    with pytest.raises(SessionGoneError):
        svc.heartbeat("alice", sid2)
    assert svc.retrieve("alice", svc.create_model("alice", sid2, 0, "tiny", None).request_id, 5).category == User


def _logprobs(svc, owner, model_id, seq_id):
    out = svc.forward_backward(owner, model_id, seq_id, [sft_datum([5, 9, 14, 22])], "cross_entropy", forward_only=True)
    return result(svc, owner, out).loss_fn_outputs[0]["logprobs"].to_torch()


def test_housekeeping_prunes_old_futures_and_expired_checkpoints(make_service):
    clock = ManualClock()
    first = make_service(future_retention_s=0.2, clock=clock)
    _, mid = new_run(first)
    keep = result(first, "alice", first.save_weights("alice", mid, 1, "keep"))
    short = result(first, "alice", first.save_weights("alice", mid, 2, "short", ttl_seconds=1))
    fb = first.forward_backward("alice", mid, 3, random_sft_datums(1, VOCAB), "cross_entropy")
    wait(first, "alice", fb)
    clock.advance(1.1)
    first.close()  # a restart on the same data: no in-memory cache, only the database answers now
    svc = make_service(data_dir=first.config.data_dir, future_retention_s=0.2, clock=clock)
    svc.housekeeping()
    with pytest.raises(NotFoundError):
        svc.retrieve("alice", fb.request_id)
    paths = [c.tinker_path for c in svc.list_checkpoints("alice", mid).checkpoints]
    assert paths == [keep.path] and short.path not in paths


def test_a_run_whose_session_ended_errored_is_listed_as_failed(make_service):
    """`corrupted` is what `tinker run list` shows as Failed: a run of a session the client
    finished "errored" (its script failed; the console shows that session so) is one."""
    svc = make_service()
    runs = {}
    for reason in ("success", "errored"):
        sid, runs[reason] = new_run(svc)
        svc.finish_session("alice", sid, reason)
    assert svc.get_training_run("alice", runs["errored"]).corrupted is True
    assert svc.get_training_run("alice", runs["success"]).corrupted is False
    listed = {r.training_run_id: r.corrupted for r in svc.list_training_runs("alice").training_runs}
    assert listed == {runs["errored"]: True, runs["success"]: False}


def test_runs_left_loaded_by_an_earlier_process_are_no_warning(make_service, tmp_path, caplog):
    """Every process leaves its runs loaded in the database (in-process `ember train` too):
    the next start on that data directory marks them unloaded without a warning."""
    first = make_service(data_dir=tmp_path / "reused")
    new_run(first)
    first.close()
    with caplog.at_level("DEBUG", logger="ember.service"):
        make_service(data_dir=tmp_path / "reused")
    assert "1 training run(s) of an earlier process" in caplog.text
    # ember's own records: an SDK client another test left in this worker may warn meanwhile (CI saw it)
    assert not [r for r in caplog.records if r.levelname == "WARNING" and r.name.startswith("ember")], caplog.text
