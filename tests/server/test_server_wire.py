"""Wire codecs against the SDK's own encoders/decoders (tinker.proto.request_conv/response_conv)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response
from tinker.types.topk_logprobs import TopkLogprobs

from ember.server import wire


def _sdk_request(data, loss_fn="cross_entropy", config=None, forward_only=False, seq_id=3) -> bytes:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="sess-1:train:0",
        seq_id=seq_id,
    )
    msg = forward_backward_request_to_proto(req)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def _datum(tokens, targets, weights):
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": targets, "weights": weights},
    )


def test_forward_backward_request_roundtrip_dense_and_config():
    data = [_datum([1, 2, 3], [2, 3, 4], [0.0, 1.0, 1.0]), _datum([70000, 5], [5, 6], [1.0, 0.5])]
    body = _sdk_request(data, loss_fn="ppo", config={"clip_low_threshold": 0.7, "note": "x"}, forward_only=True)
    call = wire.decode_forward_backward_request(body).request
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("sess-1:train:0", 3, "ppo", True)
    assert call.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7), "note": "x"}
    assert call.data[1].model_input.to_ints() == [70000, 5]
    tt = call.data[0].loss_fn_inputs["target_tokens"]
    assert tt.dtype == "int64" and tt.shape == [3] and tt.to_numpy().tolist() == [2, 3, 4]
    w = call.data[1].loss_fn_inputs["weights"]
    assert w.dtype == "float32" and w.to_numpy().tolist() == [1.0, 0.5]


def test_provenance_spans_survive_the_wire():
    """`Datum.with_provenance` spans (for stable_reinforce) decode to the same span objects."""
    model_spans = [types.PromptProvenanceSpan(sequence_id="req-a:0", offset=0, length=2),
                   types.SampledProvenanceSpan(sequence_id="req-a:0", offset=1, length=1)]
    loss_spans = [types.PromptProvenanceSpan(sequence_id="req-b:1", offset=1, length=1),
                  types.SampledProvenanceSpan(sequence_id="req-a:0", offset=0, length=0),
                  types.SampledProvenanceSpan(sequence_id="req-a:0", offset=2, length=2)]
    spanned = _datum([1, 2, 3], [2, 3, 4], [1.0, 1.0, 1.0]).with_provenance(model_input=model_spans,
                                                                         loss_fn_inputs=loss_spans)
    call = wire.decode_forward_backward_request(_sdk_request([_datum([1], [2], [1.0]), spanned], "stable_reinforce")).request
    assert call.loss_fn == "stable_reinforce"
    assert call.data[0].model_input_spans is None and call.data[0].loss_fn_input_spans is None
    assert call.data[1].model_input_spans == model_spans and call.data[1].loss_fn_input_spans == loss_spans


def test_v2_config_wins_over_legacy_map():
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="dro")
    msg.loss_fn_config["beta"] = 1.0
    msg.loss_fn_config["only_legacy"] = 2.0
    msg.loss_fn_config_v2["beta"].number = 0.25
    assert wire.merge_loss_config(msg) == {"beta": 0.25, "only_legacy": 2.0}


def test_sparse_csr_topk_decodes_to_same_dense_values():
    # A [4, 8] top-K target with 5 non-zeros: the SDK sends it as CSR (torch input).
    targets = torch.zeros(4, 8, dtype=torch.int64)
    targets[:, 0] = torch.tensor([3, 4, 5, 6])
    targets[3, 5] = 9
    weights = torch.zeros(4, 8)
    weights[:, 0] = 1.0
    weights[3, 5] = 0.5
    datum = _datum([1, 2, 3, 4], targets, weights)
    assert datum.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None  # really sparse on the wire
    call = wire.decode_forward_backward_request(_sdk_request([datum])).request
    got = call.data[0].loss_fn_inputs
    assert got["target_tokens"].sparse_crow_indices is None
    assert got["target_tokens"].shape == [4, 8]
    np.testing.assert_array_equal(got["target_tokens"].to_numpy(), targets.numpy())
    np.testing.assert_array_equal(got["weights"].to_numpy(), weights.numpy())


def test_zstd_body_is_decompressed_and_bounded():
    body = _sdk_request([_datum([1, 2], [2, 3], [1.0, 1.0])])
    packed = zstandard.ZstdCompressor().compress(body)
    assert wire.decompress_body(packed, "zstd", max_bytes=10_000) == body
    assert wire.decompress_body(body, None, max_bytes=10) == body  # identity: not re-checked here
    with pytest.raises(wire.WireError, match="exceeds the limit"):
        wire.decompress_body(packed, "zstd", max_bytes=len(body) - 1)
    with pytest.raises(wire.WireError, match="invalid zstd"):
        wire.decompress_body(b"not zstd", "zstd", max_bytes=100)
    with pytest.raises(wire.WireError, match="Content-Encoding"):
        wire.decompress_body(body, "br", max_bytes=100)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda m: setattr(m.data[0].model_input[0].encoded_text, "tokens", b"\x01\x00\x00"), "multiple of 4"),
        (lambda m: m.data[0].loss_fn_inputs["weights"].__setattr__("dtype", pb.DTYPE_BFLOAT16), "dtype expected"),
        (lambda m: m.data[0].loss_fn_inputs["weights"].__setattr__("dense", b"\x00" * 6), "multiple of 4"),
        (lambda m: m.data[0].loss_fn_inputs["weights"].shape.__setitem__(0, 5), r"shape \[5\] needs 5 values, got 2"),
        (lambda m: m.data[0].loss_fn_inputs["weights"].__setattr__(
            "dense", np.array([1.0, np.nan], dtype="<f4").tobytes()), "finite"),
        (lambda m: setattr(m, "model_id", ""), "model_id"),
    ],
)
def test_malformed_requests_raise_wire_error_naming_the_field(mutate, match):
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(_sdk_request([_datum([1, 2], [2, 3], [1.0, 1.0])]))
    mutate(msg)
    with pytest.raises(wire.WireError, match=match) as info:
        wire.decode_forward_backward_request(msg.SerializeToString())
    if "model_id" not in match:
        assert "datum 0" in str(info.value)


def test_garbage_bytes_are_a_wire_error():
    with pytest.raises(wire.WireError, match="not a valid"):
        wire.decode_forward_backward_request(b"\xff\xff\xff\xff garbage")


def test_bad_sparse_csr_is_rejected():
    t = pb.Tensor(dtype=pb.DTYPE_INT64, shape=[2, 3])
    t.sparse_csr.values = np.array([1, 2], dtype="<i8").tobytes()
    t.sparse_csr.crow_indices = np.array([0, 1, 2], dtype="<i8").tobytes()
    t.sparse_csr.col_indices = np.array([0, 3], dtype="<i8").tobytes()  # column 3 is out of range
    with pytest.raises(wire.WireError, match="col_indices must lie in"):
        wire.decode_tensor(t, where="datum 0: x")
    t.sparse_csr.col_indices = np.array([0, 2], dtype="<i8").tobytes()
    np.testing.assert_array_equal(wire.decode_tensor(t, where="x").to_numpy(), [[1, 0, 0], [0, 0, 2]])


def test_sparse_csr_dense_shape_is_bounded_before_allocation():
    # 20 bytes on the wire claiming a [1, 2**40] dense tensor: found by the fuzz (a 500, MemoryError).
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1)
    t = msg.data.add().loss_fn_inputs["weights"]
    t.dtype, t.sparse_csr.crow_indices = pb.DTYPE_FLOAT32, np.zeros(2, "<i8").tobytes()
    t.shape.extend([1, 2**40])
    with pytest.raises(wire.WireError, match=r"datum 0: loss_fn_inputs\['weights'\].*limit is 1000"):
        wire.decode_forward_backward_request(msg.SerializeToString(), max_dense_values=1000)
    del t.shape[:]
    t.shape.extend([1, 1000])  # at the limit: decodes
    decoded = wire.decode_forward_backward_request(msg.SerializeToString(), max_dense_values=1000).request
    assert decoded.data[0].loss_fn_inputs["weights"].shape == [1, 1000]


@pytest.mark.parametrize("dmel, words", [(b"", "bytes are empty"), (b"\x8e\x00\x01", "dtype byte")])
def test_bad_dmel_chunk_is_a_wire_error(dmel, words):
    # Found by the fuzz: the SDK type parses its TensorContainer lazily, so the ValueError
    # surfaced in the service's submit as a 500.
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1)
    msg.data.add().model_input.add().dmel.dmel = dmel
    with pytest.raises(wire.WireError, match=f"datum 0: model_input chunk 0: dmel: .*{words}"):
        wire.decode_forward_backward_request(msg.SerializeToString())


def test_forward_backward_output_roundtrip_through_sdk_decoder():
    outputs = [
        {"logprobs": types.TensorData.from_numpy(np.array([-1.0, -2.0, -3.0], dtype=np.float32)),
         "elementwise_loss": types.TensorData.from_numpy(np.array([0.0, 2.0, 3.0], dtype=np.float32))},
        {"logprobs": types.TensorData.from_numpy(np.array([-0.5], dtype=np.float32)),
         "elementwise_loss": types.TensorData.from_numpy(np.array([0.5], dtype=np.float32))},
        # a top-K datum: [N, K] outputs force a second ArrayRecord with trailing_shape [2]
        {"logprobs": types.TensorData.from_numpy(np.arange(6, dtype=np.float32).reshape(3, 2)),
         "elementwise_loss": types.TensorData.from_numpy(np.ones((3, 2), dtype=np.float32))},
    ]
    out = types.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs,
                                      metrics={"loss:sum": 5.5})
    decoded = deserialize_forward_backward_output(wire.encode_forward_backward_output(out))
    assert decoded.metrics == {"loss:sum": 5.5}
    assert decoded.loss_fn_output_type == "ArrayRecord"
    assert len(decoded.loss_fn_outputs) == 3
    for want, got in zip(outputs, decoded.loss_fn_outputs, strict=True):
        for name in want:
            assert got[name].shape == list(want[name].to_numpy().shape)
            np.testing.assert_array_equal(got[name].to_numpy(), want[name].to_numpy())
    msg = pb.ForwardBackwardOutput()
    msg.ParseFromString(wire.encode_forward_backward_output(out))
    assert [r.num_datums for r in msg.loss_fn_outputs] == [2, 1]
    assert list(msg.loss_fn_outputs[1].fields["logprobs"].trailing_shape) == [2]


def test_empty_forward_backward_output():
    out = types.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[], metrics={"loss:sum": 0.0})
    decoded = deserialize_forward_backward_output(wire.encode_forward_backward_output(out))
    assert decoded.loss_fn_outputs == [] and decoded.metrics == {"loss:sum": 0.0}


def test_sample_response_roundtrip_through_sdk_decoder():
    seqs = [
        types.SampledSequence(stop_reason="stop", sequence_id="s0", tokens_np=np.array([5, 6, 1], dtype=np.int32),
                              logprobs_np=np.array([-0.1, -0.2, -0.3], dtype=np.float32),
                              topk_logprobs_np=TopkLogprobs(
                                  token_ids=np.array([[5, 7], [6, 0], [1, 2]], dtype=np.int32),
                                  logprobs=np.array([[-0.1, -2], [-0.2, wire.TOPK_SENTINEL_LOGPROB], [-0.3, -3]],
                                                    dtype=np.float32))),
        types.SampledSequence(stop_reason="length", sequence_id="s1", tokens_np=np.array([9], dtype=np.int32),
                              logprobs_np=np.array([-1.5], dtype=np.float32)),
    ]
    resp = types.SampleResponse(
        sequences=seqs,
        prompt_logprobs_np=np.array([np.nan, -1.0, -2.0], dtype=np.float32),
        topk_prompt_logprobs_np=TopkLogprobs(
            token_ids=np.array([[0, 0], [4, 3], [8, 0]], dtype=np.int32),
            logprobs=np.array([[-99999.0, -99999.0], [-1.0, -1.5], [-2.0, -99999.0]], dtype=np.float32)),
    )
    got = deserialize_sample_response(wire.encode_sample_response(resp))
    assert [s.stop_reason for s in got.sequences] == ["stop", "length"]
    assert got.sequences[0].tokens == [5, 6, 1]
    assert got.sequences[1].logprobs == pytest.approx([-1.5])
    assert got.sequences[0].topk_logprobs == [[(5, pytest.approx(-0.1)), (7, -2.0)], [(6, pytest.approx(-0.2))],
                                              [(1, pytest.approx(-0.3)), (2, -3.0)]]
    assert got.sequences[1].topk_logprobs is None
    assert got.prompt_logprobs[0] is None and got.prompt_logprobs[1:] == [-1.0, -2.0]
    assert got.topk_prompt_logprobs == [None, [(4, -1.0), (3, -1.5)], [(8, -2.0)]]


def test_sample_response_from_list_form():
    # A service may build responses from Python lists: None rows and ragged top-k rows.
    resp = types.SampleResponse(
        sequences=[types.SampledSequence(stop_reason="length", sequence_id="a", _tokens_list=[1, 2],
                                         _logprobs_list=[-0.5, -0.25],
                                         _topk_logprobs_list=[[(1, -0.5), (3, -1.0)], [(2, -0.25)]])],
        _prompt_logprobs_list=[None, -0.75],
        _topk_prompt_logprobs_list=[None, [(2, -0.75)]],
    )
    got = deserialize_sample_response(wire.encode_sample_response(resp))
    assert got.sequences[0].tokens == [1, 2] and got.sequences[0].logprobs == [-0.5, -0.25]
    assert got.sequences[0].topk_logprobs == [[(1, -0.5), (3, -1.0)], [(2, -0.25)]]
    assert got.prompt_logprobs == [None, -0.75]
    assert got.topk_prompt_logprobs == [None, [(2, -0.75)]]
    raw = pb.SampleResponse()
    raw.ParseFromString(wire.encode_sample_response(resp))
    assert math.isnan(np.frombuffer(raw.prompt_logprobs, dtype="<f4")[0])
    assert raw.sequences[0].topk_sampled_logprobs.k == 2


def test_to_json_forms():
    assert wire.to_json(types.OptimStepResponse(metrics={"a:mean": 1.0})) == {"metrics": {"a:mean": 1.0}}
    assert wire.to_json(types.SaveWeightsResponse(path="tinker://r/weights/c")) == {"path": "tinker://r/weights/c"}


def _extras_response() -> types.SampleResponse:
    seq = types.SampledSequence(stop_reason="length", sequence_id="s", tokens_np=np.array([1], np.int32),
                                logprobs_np=np.array([-0.5], np.float32))
    sparse = types.TensorData(data=np.array([-1.25, -2.5], np.float32), dtype="float32", shape=[3, 10**12],
                              sparse_crow_indices=[0, 1, 1, 2], sparse_col_indices=[4, 10**12 - 1])
    alt = types.PromptAltTokens(tokens=types.TensorData.from_numpy(np.array([[1, 2], [3, 4], [5, 6]], np.int64)),
                                logprobs=types.TensorData.from_numpy(np.full((3, 2), -0.75, np.float32)))
    return types.SampleResponse(sequences=[seq], target_prompt_logprobs=sparse, prompt_alt_tokens=alt,
                                prompt_cache_hit_tokens=32)


def test_sample_response_prompt_extras_round_trip_through_the_sdk_decoder():
    """Sparse target logprobs stay sparse (a K of 10**12 is never densified); alt tokens and
    cache hits arrive as sent."""
    back = deserialize_sample_response(wire.encode_sample_response(_extras_response()))
    t = back.target_prompt_logprobs
    assert t.shape == [3, 10**12] and t.sparse_crow_indices == [0, 1, 1, 2]
    assert t.sparse_col_indices == [4, 10**12 - 1] and t.data == [-1.25, -2.5]
    assert back.prompt_alt_tokens.tokens.to_numpy().tolist() == [[1, 2], [3, 4], [5, 6]]
    assert (back.prompt_alt_tokens.logprobs.to_numpy() == -0.75).all()
    assert back.prompt_cache_hit_tokens == 32


def test_sample_response_json_keeps_prompt_extras_sparse():
    out = wire.to_json(_extras_response())
    assert out["target_prompt_logprobs"]["sparse_col_indices"] == [4, 10**12 - 1]
    assert out["target_prompt_logprobs"]["data"] == [-1.25, -2.5]
    assert out["prompt_alt_tokens"]["tokens"]["shape"] == [3, 2] and out["prompt_cache_hit_tokens"] == 32
