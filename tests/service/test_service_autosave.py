"""Runs that survive a restart, in process (README "Restarts"): a clean stop
(`Service.close(save_runs=True)`) saves every loaded run and a new Service on the same data
directory resumes it on its next request, bit for bit; `runs.autosave_every_steps` is what
comes back after an unclean end; the automatic save sits outside the checkpoint quota.
The same over HTTP with the SDK and real signals: tests/server/test_server_restart_signals.py."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from tinker import types

from helpers.datums import random_sft_datums
from ember.service.checkpoint_store import AUTOSAVE_NAME
from ember.service.config import RunsConfig
from ember.service.limits import Limits
from ember.service.runs import RESUMED_METRIC, SHUTDOWN_NOT_RUN

from .conftest import new_run, result, wait

VOCAB = 84
ADAM = types.AdamParams(learning_rate=2e-2)


def _step(svc, model_id, seq, data_seed):
    """forward_backward (seq) then optim_step (seq+1); the forward_backward's output."""
    data = random_sft_datums(3, VOCAB, seed=data_seed)
    fb = svc.forward_backward("alice", model_id, seq, data, "cross_entropy")
    result(svc, "alice", svc.optim_step("alice", model_id, seq + 1, ADAM))
    return result(svc, "alice", fb)


def _logprobs(out: types.ForwardBackwardOutput) -> list[torch.Tensor]:
    return [o["logprobs"].to_torch() for o in out.loss_fn_outputs]


def _reference(svc, steps: int) -> list[types.ForwardBackwardOutput]:
    """An uninterrupted run (same seed, same data) of `steps` steps."""
    _, ref = new_run(svc, seed=5)
    return [_step(svc, ref, 1 + 2 * i, data_seed=i) for i in range(steps)]


def _assert_same(a: types.ForwardBackwardOutput, b: types.ForwardBackwardOutput) -> None:
    assert a.metrics["loss:sum"] == b.metrics["loss:sum"]
    for x, y in zip(_logprobs(a), _logprobs(b), strict=True):
        assert torch.equal(x, y)


def test_a_clean_stop_saves_every_run_and_the_next_request_resumes_it_bit_for_bit(make_service, tmp_path):
    first = make_service()
    sid, mid = new_run(first, seed=5)
    for i in range(2):
        _step(first, mid, 1 + 2 * i, data_seed=i)
    # stopped mid-step: a forward_backward ran, its optim_step comes after the restart
    third = result(first, "alice", first.forward_backward("alice", mid, 5, random_sft_datums(3, VOCAB, seed=2),
                                                         "cross_entropy"))
    first.close(save_runs=True)

    second = make_service()
    saved = [c for c in second.list_checkpoints("alice", mid).checkpoints if c.checkpoint_id.endswith(AUTOSAVE_NAME)]
    assert [c.tinker_path for c in saved] == [f"tinker://{mid}/weights/{AUTOSAVE_NAME}"]
    result(second, "alice", second.optim_step("alice", mid, 6, ADAM))  # applies the gradient of seq 5
    fourth = _step(second, mid, 7, data_seed=3)
    assert RESUMED_METRIC not in fourth.metrics  # nothing was lost: nothing to say
    reference = _reference(second, 4)
    _assert_same(third, reference[2])
    _assert_same(fourth, reference[3])
    assert second.run_facts("alice", [mid])[mid]["steps"] == 4  # the step count came back too


def test_after_an_unclean_end_the_run_comes_back_from_its_autosave_and_says_from_which_step(make_service):
    first = make_service(runs=RunsConfig(autosave_every_steps=2))
    _, mid = new_run(first, seed=5)
    for i in range(3):
        _step(first, mid, 1 + 2 * i, data_seed=i)
    first.close()  # no save: as after SIGKILL, only the automatic save of step 2 is there

    second = make_service()
    # the client numbers on (seq 7); the run resumes from step 2, and its first answer says so
    out = _step(second, mid, 7, data_seed=2)
    assert out.metrics[RESUMED_METRIC] == 2.0
    _assert_same(out, _reference(second, 3)[2])  # the state after step 2, whatever step 3 did
    assert RESUMED_METRIC not in _step(second, mid, 9, data_seed=3).metrics  # said once


def test_the_automatic_save_is_outside_the_checkpoint_quota_and_its_name_is_reserved(make_service):
    svc = make_service(runs=RunsConfig(autosave_every_steps=1), limits=Limits(max_checkpoint_bytes_per_key=1))
    _, mid = new_run(svc)
    _step(svc, mid, 1, data_seed=0)  # saved automatically, though any checkpoint is over 1 byte
    assert [c.checkpoint_id for c in svc.list_checkpoints("alice", mid).checkpoints] == [f"weights/{AUTOSAVE_NAME}"]
    assert svc.checkpoints.bytes_used("alice") == 0
    own = wait(svc, "alice", svc.save_weights("alice", mid, 3, AUTOSAVE_NAME))
    assert own.status == "failed" and "automatic save" in own.error


def test_a_request_that_cannot_run_within_the_drain_bound_fails_retryably_and_the_run_is_saved(make_service):
    # The drain bound also bounds the final save that follows it: 0.5 s failed on a loaded host
    # (the save's write took 0.74 s), so the stuck request waits out 5 s instead.
    first = make_service(seq_gap_timeout_s=600, runs=RunsConfig(shutdown_drain_s=5.0))
    _, mid = new_run(first, seed=5)
    _step(first, mid, 1, data_seed=0)
    stuck = first.forward_backward("alice", mid, 4, random_sft_datums(1, VOCAB, seed=9), "cross_entropy")  # 3 missing
    first.close(save_runs=True)
    second = make_service()
    state = second.retrieve("alice", stuck.request_id)
    assert state.status == "failed" and state.category == types.RequestErrorCategory.Server
    assert state.error == SHUTDOWN_NOT_RUN
    out = _step(second, mid, 5, data_seed=1)  # the client numbers on
    assert out.metrics[RESUMED_METRIC] == 1.0
    _assert_same(out, _reference(second, 2)[1])


# ---------------------------------------------------------------------- sampling sessions and samples
GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0)
PROMPT = types.ModelInput.from_ints([3, 14, 15, 9, 2])


def _greedy(svc, sampler_id, seq):
    out = result(svc, "alice", svc.sample("alice", sampler_id, seq, PROMPT, 1, GREEDY))
    return list(out.sequences[0].tokens)


def _snapshot(svc, mid, seq, sampling_seq, kind="snapshot"):
    sub = svc.save_weights_for_sampler("alice", mid, seq, None, sampling_session_seq_id=sampling_seq, kind=kind)
    return result(svc, "alice", sub).sampling_session_id


def _new_run(svc, kind):
    if kind == "lora":
        return new_run(svc, seed=5)[1]
    sid = svc.create_session("alice").session_id
    return result(svc, "alice", svc.create_model("alice", sid, 0, "tiny", None)).model_id


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_a_snapshot_sampling_session_of_the_current_weights_comes_back_after_a_clean_stop(make_service, kind):
    first = make_service(limits=Limits(max_checkpoint_bytes_per_key=1))
    mid = _new_run(first, kind)
    _step(first, mid, 1, data_seed=0)
    stale = _snapshot(first, mid, 3, 0)  # the weights of step 1: not the run's weights at the stop
    stale_before = _greedy(first, stale, 0)
    _step(first, mid, 4, data_seed=1)
    current = _snapshot(first, mid, 6, 1)
    before = _greedy(first, current, 0)
    assert before != stale_before  # the step changed what greedy sampling gives: the test can tell them apart
    first.close(save_runs=True)

    second = make_service()
    assert _greedy(second, current, 1) == before  # the same session id, the same weights
    assert _greedy(second, stale, 1) == stale_before  # older weights too: the sampler gave them back
    saved = second.checkpoints.row(f"tinker://{mid}/sampler_weights/{AUTOSAVE_NAME}")
    assert saved is not None and saved.size_bytes > 0
    assert second.checkpoints.bytes_used("alice") == 0  # the server's save, outside the quota
    # the run comes back with the same weights (a forward_backward changes none) and takes a
    # new snapshot of them: the stop saves both sessions (the new save replaces the old)
    result(second, "alice", second.forward_backward("alice", mid, 7, random_sft_datums(3, VOCAB, seed=4),
                                                    "cross_entropy"))
    again = _snapshot(second, mid, 8, 2)
    second.close(save_runs=True)

    third = make_service()
    assert _greedy(third, current, 2) == before
    assert _greedy(third, again, 0) == before
    assert _greedy(third, stale, 2) == stale_before  # a session restored is saved again at the next stop


def test_an_inflight_sampling_session_comes_back_after_a_clean_stop_following_the_runs_saved_weights(make_service):
    first = make_service()
    mid = _new_run(first, "lora")
    _step(first, mid, 1, data_seed=0)
    inflight = _snapshot(first, mid, 3, 0, kind="inflight")  # its target: the weights of step 1
    _step(first, mid, 4, data_seed=1)
    newest = _greedy(first, _snapshot(first, mid, 6, 1), 0)  # the run's weights at the stop
    first.close(save_runs=True)

    second = make_service()
    # "the weights saved when the client was created, or newer": the run's weights at the stop
    assert _greedy(second, inflight, 0) == newest
    # and it follows the run's next in-flight save, as before the restart
    _step(second, mid, 7, data_seed=2)
    later = _snapshot(second, mid, 9, 2, kind="inflight")
    assert second.samplers.inflight_generation(mid) == 1
    assert _greedy(second, inflight, 1) == _greedy(second, later, 0)


@contextlib.contextmanager
def _sample_held_through_a_stop(svc, sampler_id):
    """A sample held in the sampler by a fail point while `svc` stops cleanly on a thread:
    yields (the sample's submission, the stopping thread); the sample is let go on exit."""
    from ember import failpoints
    from helpers.server import wait_until

    failpoints.arm("sampler.decode_request", "hold", times=1)
    try:
        running = svc.sample("alice", sampler_id, 0, PROMPT, 1, GREEDY)
        wait_until(lambda: not failpoints.pending("sampler.decode_request"), 60, message="the sample held")
        stopping = threading.Thread(target=svc.close, kwargs={"save_runs": True})
        stopping.start()
        yield running, stopping
    finally:
        failpoints.release("sampler.decode_request")


def test_samples_running_at_a_clean_stop_finish_within_the_drain_bound(make_service):
    from ember.service.samplers import SAMPLE_STOPPING
    from helpers.server import wait_until

    svc = make_service(runs=RunsConfig(shutdown_drain_s=600))
    _, mid = new_run(svc, seed=5)
    sampler_id = _snapshot(svc, mid, 1, 0)
    with _sample_held_through_a_stop(svc, sampler_id) as (running, stopping):
        refused = wait_until(lambda: _refused(svc, sampler_id), 60, message="new samples refused")
        assert refused.category == types.RequestErrorCategory.Server and refused.error == SAMPLE_STOPPING
    stopping.join(120)
    assert not stopping.is_alive()
    state = make_service().retrieve("alice", running.request_id)
    assert state.status == "complete" and len(state.result.sequences[0].tokens) == GREEDY.max_tokens


def _refused(svc, sampler_id):
    state = wait(svc, "alice", svc.sample("alice", sampler_id, None, PROMPT, 1, GREEDY))
    return state if state.status == "failed" else None


def test_a_sample_still_running_at_the_drain_bound_fails_retryably(make_service):
    from ember.service.samplers import SAMPLE_SHUTDOWN
    from helpers.server import wait_until

    svc = make_service(runs=RunsConfig(shutdown_drain_s=0.5))
    _, mid = new_run(svc, seed=5)
    sampler_id = _snapshot(svc, mid, 1, 0)
    with _sample_held_through_a_stop(svc, sampler_id) as (running, stopping):
        wait_until(lambda: svc.stored_future(running.request_id).status == "failed", 60, message="the sample failed")
    stopping.join(120)
    state = make_service().retrieve("alice", running.request_id)
    assert state.status == "failed" and state.category == types.RequestErrorCategory.Server
    assert state.error == SAMPLE_SHUTDOWN


def _older_folders(svc, mid):
    from pathlib import Path

    saved = svc.checkpoints.row(f"tinker://{mid}/sampler_weights/{AUTOSAVE_NAME}")
    return sorted(p.name for p in Path(saved.directory).iterdir() if p.is_dir())


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_a_snapshot_of_older_weights_comes_back_from_the_automatic_save_after_an_unclean_end(make_service, kind):
    first = make_service(runs=RunsConfig(autosave_every_steps=2))
    mid = _new_run(first, kind)
    _step(first, mid, 1, data_seed=0)
    older = _snapshot(first, mid, 3, 0)  # the weights of step 1; step 2's automatic save keeps them
    before = _greedy(first, older, 0)
    _step(first, mid, 4, data_seed=1)
    assert len(_older_folders(first, mid)) == 1
    first.close()  # no save at the end: as after SIGKILL

    second = make_service()
    assert _greedy(second, older, 1) == before


def test_a_tampered_folder_in_the_snapshot_record_is_refused_and_the_rest_of_the_run_restores(make_service, caplog):
    import json
    from pathlib import Path

    from ember.service.samplers import SNAPSHOT_RECORD

    first = make_service()
    mid = _new_run(first, "lora")
    _step(first, mid, 1, data_seed=0)
    older = _snapshot(first, mid, 3, 0)
    _step(first, mid, 4, data_seed=1)
    current = _snapshot(first, mid, 6, 1)
    before = _greedy(first, current, 0)
    first.close(save_runs=True)

    saved = first.checkpoints.row(f"tinker://{mid}/sampler_weights/{AUTOSAVE_NAME}")
    record_file = Path(saved.directory) / SNAPSHOT_RECORD
    record = json.loads(record_file.read_text())
    record["older_sessions"][older]["folder"] = "../../.."  # outside the run's automatic save
    record_file.write_text(json.dumps(record))

    second = make_service()
    with caplog.at_level("ERROR", logger="ember"):
        lost = wait(second, "alice", second.sample("alice", older, 0, PROMPT, 1, GREEDY))
    assert lost.status == "failed" and "create a new sampling client" in lost.error
    refused = [r.getMessage() for r in caplog.records if r.name.startswith("ember") and r.levelname == "ERROR"]
    assert any(older in m and "'../../..'" in m and "refused" in m for m in refused), refused
    assert _greedy(second, current, 1) == before  # the other session, from the same record
    _step(second, mid, 7, data_seed=2)  # and the run trains on
    assert second.run_facts("alice", [mid])[mid]["steps"] == 3


def test_older_folders_no_session_holds_any_more_go_at_the_next_save(make_service):
    first = make_service(runs=RunsConfig(autosave_every_steps=1), max_samplers_per_session=1)
    mid = _new_run(first, "lora")
    _step(first, mid, 1, data_seed=0)
    one = _snapshot(first, mid, 3, 0)
    _step(first, mid, 4, data_seed=1)  # saves `one`'s weights in their folder
    assert len(folders := _older_folders(first, mid)) == 1
    _snapshot(first, mid, 6, 1)  # evicts `one` (one sampling client per session)
    _step(first, mid, 7, data_seed=2)
    now = _older_folders(first, mid)
    assert len(now) == 1 and now != folders  # the evicted one's folder went; the new one's came
