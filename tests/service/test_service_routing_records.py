"""Routing records (`ember.service.routing_records`): a MoE sample's routes kept in its
stability records (accounted bytes), a datum's routes from the records its provenance names
(-1 where none exists), refusals naming datum and field, the `routing_replay` option."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types

from ember.engine.moe import ROUTES_KEY
from ember.sampling.experts import RoutedSequence
from ember.service.api import UserError
from ember.service.routing_records import datum_routes, replay_option, with_routes
from ember.service.stability import StabilityRecords

PROMPT = [3, 4, 5]
SAMPLED = [7, 8, 9, 10]
LAYERS, K = 2, 2


def routed(sid: str, layers: int = LAYERS, fed: int = len(SAMPLED) - 1, offset: int = 0) -> RoutedSequence:
    g = np.random.default_rng(offset)
    return RoutedSequence(stop_reason="length", sequence_id=sid, tokens_np=np.array(SAMPLED, np.int32),
                          logprobs_np=np.full(len(SAMPLED), -1.0, np.float32),
                          prompt_routes_np=g.integers(0, 4, (len(PROMPT), layers, K)).astype(np.int16),
                          routes_np=g.integers(0, 4, (fed, layers, K)).astype(np.int16))


def record(records: StabilityRecords, *seqs) -> None:
    records.record("alice", "sess", types.ModelInput.from_ints(PROMPT), types.SampleResponse(sequences=list(seqs)))


def datum(sid: str = "s:0", whole: bool = False) -> types.Datum:
    """prompt + sampled[:-1] as an RL loop feeds it; `whole`: every sampled token in the
    input (targets: placeholders under the prompt run, then the sampled tokens)."""
    if whole:
        d = types.Datum(model_input=types.ModelInput.from_ints(PROMPT + SAMPLED),
                        loss_fn_inputs={"target_tokens": [0] * len(PROMPT) + SAMPLED})
        loss_spans = [types.PromptProvenanceSpan(sequence_id=sid, length=len(PROMPT)),
                      types.SampledProvenanceSpan(sequence_id=sid, length=len(SAMPLED))]
        sampled_run = len(SAMPLED)
    else:
        full = PROMPT + SAMPLED
        d = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={"target_tokens": full[1:]})
        loss_spans = [types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(PROMPT) - 1),
                      types.SampledProvenanceSpan(sequence_id=sid, length=len(SAMPLED))]
        sampled_run = len(SAMPLED) - 1
    return d.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, length=len(PROMPT)),
                     types.SampledProvenanceSpan(sequence_id=sid, length=sampled_run)],
        loss_fn_inputs=loss_spans)


def test_routes_of_a_datum_and_where_none_exist():
    records = StabilityRecords()
    seq = routed("s:0")
    record(records, seq)
    got = datum_routes(records, "alice", "sess", 0, datum())
    np.testing.assert_array_equal(got, np.concatenate([seq.prompt_routes_np, seq.routes_np]))
    whole = datum_routes(records, "alice", "sess", 0, datum(whole=True))  # the last token: never run
    assert (whole[-1] == -1).all() and np.array_equal(whole[:-1], got)
    no_provenance = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3]})
    assert datum_routes(records, "alice", "sess", 0, no_provenance) is None
    out = with_routes(records, "alice", "sess", [no_provenance, datum()], [no_provenance, datum()])
    assert ROUTES_KEY not in out[0].loss_fn_inputs
    np.testing.assert_array_equal(out[1].loss_fn_inputs[ROUTES_KEY].to_numpy(), got)


def test_a_dense_sample_has_no_routes_and_routes_cost_their_bytes():
    dense, moe = StabilityRecords(), StabilityRecords()
    plain = types.SampledSequence(stop_reason="length", sequence_id="s:0", tokens_np=np.array(SAMPLED, np.int32),
                                  logprobs_np=np.full(len(SAMPLED), -1.0, np.float32))
    record(dense, plain)
    assert datum_routes(dense, "alice", "sess", 0, datum()) is None
    seq = routed("s:0")
    record(moe, seq)
    assert moe.bytes_used() - dense.bytes_used() == seq.routes_np.nbytes + seq.prompt_routes_np.nbytes


def test_mismatched_records_are_refused_naming_datum_and_field():
    records = StabilityRecords()
    record(records, routed("short", fed=1))
    with pytest.raises(UserError, match=r"datum 0: model_input_spans\[1\]: the routing record of sequence_id "
                                        r"'short' holds 1 routes for its 3 sampled tokens"):
        datum_routes(records, "alice", "sess", 0, datum("short"))
    records.record("alice", "sess", types.ModelInput.from_ints(PROMPT),
                   types.SampleResponse(sequences=[routed("three", layers=3)]))
    mixed = types.Datum(model_input=types.ModelInput.from_ints(PROMPT + SAMPLED[:3]),
                        loss_fn_inputs={"target_tokens": PROMPT[1:] + SAMPLED}).with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="short", length=len(PROMPT)),
                     types.SampledProvenanceSpan(sequence_id="three", length=3)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id="three", offset=1, length=len(PROMPT) - 1),
                        types.SampledProvenanceSpan(sequence_id="three", length=4)])
    with pytest.raises(UserError, match=r"datum 0: model_input_spans\[1\]: .*'three' has \(3, 2\)"):
        datum_routes(records, "alice", "sess", 0, mixed)
    with pytest.raises(UserError, match=r"datum 0: model_input_spans\[0\]: tokens do not match"):
        bad = datum("short")
        datum_routes(records, "alice", "sess", 0, types.Datum(
            model_input=types.ModelInput.from_ints([1] + PROMPT[1:] + SAMPLED[:3]), loss_fn_inputs=bad.loss_fn_inputs,
            model_input_spans=bad.model_input_spans, loss_fn_input_spans=bad.loss_fn_input_spans))


@pytest.mark.parametrize("config, default, expected", [
    (None, False, (None, False)), (None, True, (None, True)),
    ({"routing_replay": 1.0}, False, (None, True)), ({"routing_replay": 0, "beta": 0.1}, True, ({"beta": 0.1}, False)),
])
def test_the_option_is_taken_out_of_the_loss_config(config, default, expected):
    assert replay_option(config, default) == expected


@pytest.mark.parametrize("value", [0.5, 2, True, "1", float("nan")])
def test_the_option_is_0_or_1(value):
    with pytest.raises(UserError, match=r"loss_fn_config\['routing_replay'\] must be 0"):
        replay_option({"routing_replay": value}, False)
