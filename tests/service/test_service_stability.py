"""Stability records (`ember.service.stability`) and provenance resolution
(`ember.service.provenance`) without a model: scoping, expiry, memory bounds, and every
user error naming datum, field, span and reason."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tinker import types

from ember.service.api import UserError
from ember.service import stability
from ember.sampling.follow import with_spans
from ember.service.stability import DAY_S, StabilityConfig, StabilityRecords

PROMPT = [3, 4, 5]
SAMPLED = {"s:0": ([7, 8, 9, 10], [-0.5, -1.0, -1.5, -2.0]), "s:1": ([11, 12], [-0.25, -0.75])}


def seq(sid: str, tokens, logprobs) -> types.SampledSequence:
    return types.SampledSequence(stop_reason="length", sequence_id=sid, tokens_np=np.asarray(tokens, np.int32),
                                 logprobs_np=np.asarray(logprobs, np.float32))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def response(ids=("s:0", "s:1")) -> types.SampleResponse:
    return types.SampleResponse(sequences=[seq(i, *SAMPLED[i]) for i in ids])


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def records(clock):
    rec = StabilityRecords(StabilityConfig(), clock=clock)
    rec.record("alice", "sess-a", types.ModelInput.from_ints(PROMPT), response())
    return rec


def datum(sid="s:0", advantage=1.0) -> types.Datum:
    """Input prompt + sampled[:-1], targets prompt[1:] + sampled (as an RL loop builds it)."""
    sampled = SAMPLED[sid][0]
    full = PROMPT + sampled
    d = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:], "advantages": [advantage] * (len(full) - 1),
                                    "logprobs": [9.0] * (len(full) - 1)})
    return d.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, length=3),
                     types.SampledProvenanceSpan(sequence_id=sid, length=len(sampled) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=2),
                        types.SampledProvenanceSpan(sequence_id=sid, length=len(sampled))])


def refused(records, data, *words, owner="alice", session="sess-a") -> str:
    with pytest.raises(UserError) as info:
        records.resolve(owner, session, data)
    for w in words:
        assert w in str(info.value), str(info.value)
    return str(info.value)


def test_resolution_fills_recorded_logprobs_and_mask(records):
    out = records.resolve("alice", "sess-a", [datum("s:0"), datum("s:1")])
    q0 = out[0].loss_fn_inputs["logprobs"].to_numpy()
    # the client's logprobs (9.0) are replaced by the record; prompt rows get 0
    np.testing.assert_array_equal(q0, np.array([0, 0, -0.5, -1.0, -1.5, -2.0], dtype=np.float32))
    np.testing.assert_array_equal(out[0].loss_fn_inputs["sampled_mask"].to_numpy(), [0, 0, 1, 1, 1, 1])
    q1 = out[1].loss_fn_inputs["logprobs"].to_numpy()
    np.testing.assert_array_equal(q1, np.array([0, 0, -0.25, -0.75], np.float32))
    assert out[0].model_input_spans is None and out[0].loss_fn_inputs["advantages"].tolist() == [1.0] * 6


def test_two_sequences_back_to_back_in_one_datum(records):
    """A multi-turn datum: prompt, sequence 0, then sequence 1 (its own runs)."""
    a, b = SAMPLED["s:0"][0], SAMPLED["s:1"][0]
    full = PROMPT + a + b
    d = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:], "advantages": [1.0] * (len(full) - 1)})
    d = d.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="s:0", length=3),
                     types.SampledProvenanceSpan(sequence_id="s:0", length=4),
                     types.SampledProvenanceSpan(sequence_id="s:1", length=1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id="s:1", offset=1, length=2),
                        types.SampledProvenanceSpan(sequence_id="s:0", length=4),
                        types.SampledProvenanceSpan(sequence_id="s:1", length=2)])
    q = records.resolve("alice", "sess-a", [d])[0].loss_fn_inputs["logprobs"].to_numpy()
    np.testing.assert_array_equal(q, np.array([0, 0, -0.5, -1, -1.5, -2, -0.25, -0.75], np.float32))


def test_missing_provenance(records):
    plain = dataclasses.replace(datum(), model_input_spans=None, loss_fn_input_spans=None)
    refused(records, [datum(), plain], "datum 1:", "needs provenance", "with_provenance")


def test_foreign_owner_and_other_session_read_as_unknown(records):
    unknown = refused(records, [dataclasses.replace(datum(), model_input_spans=[
        types.PromptProvenanceSpan(sequence_id="nope", length=3),
        types.SampledProvenanceSpan(sequence_id="s:0", length=3)])],
        "datum 0: model_input_spans[0]", "no stability record for sequence_id 'nope' in this session")
    foreign = refused(records, [datum()], owner="bob", session="sess-a")
    other_session = refused(records, [datum()], session="sess-b")
    # the same words whether the id is unknown, another tenant's, or another session's
    assert foreign == other_session == unknown.replace("'nope'", "'s:0'")


def test_expiry_is_sliding_and_named(records, clock):
    clock.now += DAY_S - 1
    records.resolve("alice", "sess-a", [datum()])  # used: its day restarts
    clock.now += DAY_S - 1
    records.resolve("alice", "sess-a", [datum()])
    clock.now += DAY_S + 3600
    refused(records, [datum()], "datum 0: model_input_spans[0]", "expired", "last used 25.0 h ago",
            "records live 24.0 h")
    # s:1 was never used after sampling: housekeeping drops it; it then reads as unknown
    assert records.expire() == 1 and len(records) == 0
    refused(records, [datum("s:1")], "no stability record")


def test_session_end_drops_its_records(records):
    records.record("alice", "sess-b", types.ModelInput.from_ints(PROMPT), response(("s:1",)))  # s:1 now sess-b's
    records.drop_session("sess-a")
    assert len(records) == 1
    refused(records, [datum("s:0")], "no stability record")
    records.resolve("alice", "sess-b", [datum("s:1")])


def test_tokens_must_match_the_record(records):
    d = datum()
    wrong_input = dataclasses.replace(d, model_input=types.ModelInput.from_ints([3, 4, 6, 7, 8, 9]))
    refused(records, [wrong_input], "datum 0: model_input_spans[0]", "position 2 holds 6", "prompt token 2 is 5")
    targets = d.loss_fn_inputs["target_tokens"].tolist()
    targets[4] = 1
    wrong_target = dataclasses.replace(d, loss_fn_inputs={**d.loss_fn_inputs, "target_tokens": targets})
    refused(records, [wrong_target], "datum 0: loss_fn_input_spans[1]", "position 4 holds 1",
            "sampled token 2 is 9")


def test_prompt_targets_are_placeholders_but_sampled_targets_must_match(records):
    """tinker-cookbook's rl_loop sends ``[0] * ob_len + sampled`` as targets, with a prompt run
    over the zeros: prompt targets carry no loss, so any ids pass there (the resolution is
    the same as with the true prompt tokens); a wrong sampled target is still refused."""
    d = datum()
    targets = d.loss_fn_inputs["target_tokens"].tolist()
    zeros = dataclasses.replace(d, loss_fn_inputs={**d.loss_fn_inputs, "target_tokens": [0, 0] + targets[2:]})
    got, want = records.resolve("alice", "sess-a", [zeros, d])
    for key in ("logprobs", "sampled_mask"):
        np.testing.assert_array_equal(got.loss_fn_inputs[key].to_numpy(), want.loss_fn_inputs[key].to_numpy())
    wrong = [0, 0] + targets[2:4] + [1] + targets[5:]
    refused(records, [dataclasses.replace(d, loss_fn_inputs={**d.loss_fn_inputs, "target_tokens": wrong})],
            "datum 0: loss_fn_input_spans[1]", "position 4 holds 1", "sampled token 2 is 9")
    # the input tokens are what the model computes on: a placeholder there is refused
    refused(records, [dataclasses.replace(d, model_input=types.ModelInput.from_ints([0, 0, 0, 7, 8, 9]))],
            "datum 0: model_input_spans[0]", "position 0 holds 0", "prompt token 0 is 3")
    # a placeholder run still has to lie within the recorded prompt
    out_of_range = dataclasses.replace(zeros, loss_fn_input_spans=[
        types.PromptProvenanceSpan(sequence_id="s:0", offset=2, length=2),
        types.SampledProvenanceSpan(sequence_id="s:0", length=4)])
    refused(records, [out_of_range], "datum 0: loss_fn_input_spans[0]", "offset 2 + length 2 = 4 exceeds")


def test_runs_must_tile_and_stay_in_range(records):
    d = datum()
    refused(records, [dataclasses.replace(d, loss_fn_input_spans=d.loss_fn_input_spans[1:])],
            "datum 0: loss_fn_input_spans", "cover 4 positions", "has 6", "tile")
    refused(records, [dataclasses.replace(d, model_input_spans=[
        types.PromptProvenanceSpan(sequence_id="s:0", offset=2, length=3),
        types.SampledProvenanceSpan(sequence_id="s:0", length=3)])],
        "datum 0: model_input_spans[0]", "offset 2 + length 3 = 5 exceeds the 3 recorded prompt tokens")


def test_prompt_with_images_cannot_be_a_prompt_span(clock):
    rec = StabilityRecords(clock=clock)
    img = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=PROMPT),
                                   types.ImageChunk(data=b"x", format="png", expected_tokens=1)])
    rec.record("alice", "sess-a", img, response(("s:0",)))
    refused(rec, [datum()], "datum 0: model_input_spans[0]", "non-token chunks")


def cost(*responses: types.SampleResponse) -> int:
    """Accounted bytes of recording these responses (each with PROMPT), in an unbounded store."""
    rec = StabilityRecords()
    for r in responses:
        rec.record("x", "sess-x", types.ModelInput.from_ints(PROMPT), r)
    return rec.bytes_used()


def test_memory_bounds_evict_least_recently_used(clock):
    # budgets in bytes: alice fits s:0 + s:1 (one sample) and s:0 + s:2, not all three; the
    # total fits alice's two records and bob's one
    s2 = types.SampleResponse(sequences=[seq("s:2", [1], [-1.0])])
    b0 = types.SampleResponse(sequences=[seq("b:0", [1, 2, 3, 4], [-1.0] * 4)])
    scratch = StabilityRecords()
    scratch.record("x", "sess-x", types.ModelInput.from_ints(PROMPT), response(("s:0", "s:1")))
    s0 = scratch.lookup("x", "sess-x", "s:0", "test").nbytes  # s:0 as recorded with s:1
    per_owner = s0 + cost(s2)
    assert cost(response(("s:0", "s:1"))) <= per_owner < cost(response(("s:0", "s:1"))) + cost(s2)
    rec = StabilityRecords(StabilityConfig(max_bytes_per_owner=per_owner, max_bytes_total=per_owner + cost(b0)),
                           clock=clock)
    prompt = types.ModelInput.from_ints(PROMPT)
    rec.record("alice", "sess-a", prompt, response(("s:0", "s:1")))  # 12: at alice's bound
    clock.now += 1
    rec.record("bob", "sess-b", prompt, types.SampleResponse(sequences=[
        seq("b:0", [1, 2, 3, 4], [-1.0] * 4)]))
    # total 19 <= 20: nothing evicted; alice reuses s:0, so s:1 is her least recently used
    rec.resolve("alice", "sess-a", [datum("s:0")])
    rec.record("alice", "sess-a", prompt, types.SampleResponse(sequences=[
        seq("s:2", [1], [-1.0])]))
    # alice at 16 > 12: her LRU (s:1) goes; total 7 + 7 + 4 = 18 fits; bob untouched
    refused(rec, [datum("s:1")], "no stability record")
    rec.resolve("alice", "sess-a", [datum("s:0")])
    rec.resolve("bob", "sess-b", [])
    assert len(rec) == 3


def test_total_bound_evicts_across_owners(clock):
    one = cost(types.SampleResponse(sequences=[seq("x:0", [7, 8, 9, 10], [-1.0] * 4)]))
    rec = StabilityRecords(StabilityConfig(max_bytes_per_owner=100 * one, max_bytes_total=2 * one), clock=clock)
    prompt = types.ModelInput.from_ints(PROMPT)
    for owner, sid in (("alice", "s:0"), ("bob", "b:0"), ("carol", "c:0")):  # `one` each
        sampled = types.SampleResponse(sequences=[seq(sid, [7, 8, 9, 10], [-1.0] * 4)])
        rec.record(owner, f"sess-{owner}", prompt, sampled)
        clock.now += 1
    assert len(rec) == 2
    refused(rec, [datum("s:0")], "no stability record")  # the oldest, alice's, went first


@pytest.mark.parametrize("kwargs, words", [
    ({"ttl_s": 0}, "ttl_s must be > 0"),
    ({"max_bytes_per_owner": 0}, "max_bytes_per_owner must be an integer >= 1, got 0"),
    ({"max_bytes_total": 1.5}, "max_bytes_total must be an integer >= 1, got 1.5"),
])
def test_config_checked(kwargs, words):
    with pytest.raises(ValueError, match=words):
        StabilityConfig(**kwargs)


def _sample(base: str, n: int, length: int) -> types.SampleResponse:
    return types.SampleResponse(sequences=[
        seq(f"{base}-{i}", np.arange(length) % 50, np.full(length, -1.0)) for i in range(n)])


# slow: tracemalloc keeps 100 frames of every allocation of the whole process (an xdist
# worker's other threads too) for seconds; the eviction and bound tests here stay in test-fast.
@pytest.mark.slow
@pytest.mark.parametrize("n, length, prompt_len", [(1, 1, 1), (4, 2, 3), (4, 300, 100)])
def test_accounting_is_real_bytes(n, length, prompt_len):
    """The accounted bytes are what the records take (tracemalloc), within 20%."""
    import gc
    import tracemalloc

    rec = StabilityRecords()
    prompts = [types.ModelInput.from_ints(list(range(prompt_len))) for _ in range(100)]
    samples = [_sample(f"req-{i:08d}-abcdef", n, length) for i in range(100)]
    gc.collect()
    tracemalloc.start(100)
    try:
        for i, (prompt, sample) in enumerate(zip(prompts, samples)):
            rec.record("owner-a", f"sess-{i % 10}", prompt, sample)
        del samples, sample
        gc.collect()
        snapshot = tracemalloc.take_snapshot()
    finally:
        # Stopped before the traces are read: reading them builds ~100 Frame objects per
        # trace, each of which a running tracemalloc would trace with its 100 frames (that
        # made this test take 10-20 s instead of 2).
        tracemalloc.stop()
    # Only what this loop allocated: the process's other threads (a server, an SDK
    # heartbeat left by an earlier test in this worker) allocate meanwhile too.
    # A trace is ours when any of its frames is in one of these files (what
    # tracemalloc.Filter(True, path, all_frames=True) matches, without its fnmatch per frame).
    mine = {stability.__file__, __file__}
    real = sum(t.size for t in snapshot.traces if any(f.filename in mine for f in t.traceback))
    assert len(rec) == 100 * n
    assert abs(rec.bytes_used() - real) <= 0.2 * real, (rec.bytes_used() / len(rec), real / len(rec))


def test_eviction_takes_the_owners_least_recently_used_and_spares_others(clock):
    one = cost(_sample("x", 1, 4))
    rec = StabilityRecords(StabilityConfig(max_bytes_per_owner=3 * one, max_bytes_total=100 * one), clock=clock)
    prompt = types.ModelInput.from_ints(PROMPT)
    rec.record("bob", "sess-b", prompt, _sample("b", 1, 4))
    for i in range(3):
        rec.record("alice", "sess-a", prompt, _sample(f"a{i}", 1, 4))
        clock.now += 1
    rec.lookup("alice", "sess-a", "a0-0", "test")  # a0 is now alice's most recently used: a1 goes next
    for i in range(3, 5):
        rec.record("alice", "sess-a", prompt, _sample(f"a{i}", 1, 4))
    alive = {sid for sid in ("a0-0", "a1-0", "a2-0", "a3-0", "a4-0") if _has(rec, "alice", "sess-a", sid)}
    assert alive == {"a0-0", "a3-0", "a4-0"}
    assert _has(rec, "bob", "sess-b", "b-0")  # another owner's budget is its own
    assert rec.bytes_used("alice") == 3 * one and rec.bytes_used() == 4 * one
    rec.drop_session("sess-a")
    assert rec.bytes_used("alice") == 0 and len(rec) == 1


def test_expiry_drops_oldest_first_and_stops_at_the_first_live(clock):
    rec = StabilityRecords(StabilityConfig(ttl_s=10.0), clock=clock)
    prompt = types.ModelInput.from_ints(PROMPT)
    rec.record("alice", "sess-a", prompt, _sample("a0", 1, 2))  # t = 1000
    rec.record("alice", "sess-a", prompt, _sample("a1", 1, 2))
    clock.now += 5
    rec.record("alice", "sess-a", prompt, _sample("a2", 1, 2))  # t = 1005
    clock.now += 3
    rec.lookup("alice", "sess-a", "a0-0", "test")  # t = 1008: a0 used again, lives on
    clock.now += 1
    rec.record("alice", "sess-a", prompt, _sample("a3", 1, 2))  # t = 1009
    clock.now += 7  # t = 1016: a1 (1000) and a2 (1005) are over 10 s old
    assert rec.expire() == 2
    assert _has(rec, "alice", "sess-a", "a0-0") and _has(rec, "alice", "sess-a", "a3-0")
    assert not _has(rec, "alice", "sess-a", "a1-0") and len(rec) == 2


def _has(rec: StabilityRecords, owner: str, session: str, sid: str) -> bool:
    try:
        rec.lookup(owner, session, sid, "test")
    except UserError:
        return False
    return True


def test_a_followed_sequence_keeps_its_version_spans(clock):
    spanning = with_spans(seq("s:0", *SAMPLED["s:0"]), [(0, 3), (2, 4)])
    scratch = StabilityRecords(StabilityConfig(), clock=clock)
    scratch.record("x", "sess-x", types.ModelInput.from_ints(PROMPT),
                   types.SampleResponse(sequences=[spanning, seq("s:1", *SAMPLED["s:1"])]))
    assert scratch.lookup("x", "sess-x", "s:0", "test").version_spans == ((0, 3), (2, 4))
    assert scratch.lookup("x", "sess-x", "s:1", "test").version_spans is None  # not followed: one version


def test_provenance_reports_spans_to_their_owner_only(clock):
    spanning = with_spans(seq("s:0", *SAMPLED["s:0"]), [(0, 3), (2, 4)])
    scratch = StabilityRecords(StabilityConfig(), clock=clock)
    scratch.record("x", "sess-x", types.ModelInput.from_ints(PROMPT),
                   types.SampleResponse(sequences=[spanning, seq("s:1", *SAMPLED["s:1"])]))
    assert scratch.provenance("x", "sess-x", "s:0") == {
        "session_id": "sess-x", "sequence_id": "s:0", "num_tokens": len(SAMPLED["s:0"][0]),
        "version_spans": [{"first_token": 0, "generation": 3}, {"first_token": 2, "generation": 4}],
        "spans_a_swap": True}
    one = scratch.provenance("x", "sess-x", "s:1")
    assert one["version_spans"] is None and one["spans_a_swap"] is False
    for owner, session in (("y", "sess-x"), ("x", "sess-y")):  # another owner or session: as if absent
        with pytest.raises(UserError, match="sequence_provenance: no stability record for sequence_id 's:0'"):
            scratch.provenance(owner, session, "s:0")
