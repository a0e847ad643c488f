"""The pure checks behind issue 24's hostile-input fixes, without a server: JSON bodies
(`requests.decode_json`), protobuf field counts and sparse budgets (`wire`), top-K width
(`losses.validation`), `user_metadata` bounds and OpenAI answer bounds and encoding.
`test_server_hostile_input.py` replays the attacks against a real `ember serve`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from tinker.proto import tinker_public_pb2 as pb

from ember.losses.validation import validate_datum_inputs
from ember.server import openai_compat as oa
from ember.server import wire
from ember.server.errors import BadRequest
from ember.server.requests import decode_json
from ember.server.routes_openai import json_pieces
from ember.service.api import UserError
from ember.service.limits import Limits, check_json_tree

LIMITS = Limits()


@pytest.mark.parametrize("raw, where", [
    (b'{"request_id":"\\udcff"}', "body.request_id: holds a lone UTF-16 surrogate"),
    (b'{"a":{"k\\ud800":1}}', "body.a.k\\ud800: holds a lone"),
    (b'{"p":["ok","x\\udfffy"]}', "body.p[1]: holds a lone"),
    # deeper than the parser goes at any recursion limit (torch's inductor raises it when a worker imports it)
    (b"[" * 20_000 + b"]" * 20_000, "body: nested deeper than 64"),
    (b'{"m":' + b"[" * 5000 + b"]" * 5000 + b"}", "body.m: nested deeper than 64"),
    (b'{"s":"[[[[\\"", "m":' + b"[" * 3000 + b"]" * 3000 + b"}", "body.m: nested deeper"),  # brackets in strings
    (b'{"m":' + b"[" * 65 + b"]" * 65 + b"}", "body.m[0][0][0][0][0][0][0]...(56 more levels): nested deeper"),
    (b"[" + b"1," * 400_000 + b"1]", "max_json_values=400000"),
    (b"{bad", "invalid JSON"),
])
def test_hostile_json_is_a_bad_request_naming_the_field(raw, where):
    with pytest.raises(BadRequest) as refused:
        decode_json(raw, LIMITS)
    assert where in str(refused.value)


def test_valid_json_passes_unchanged():
    doc = {"prompt": "a[b{c", "pair": "\U0001f600", "nested": [[{"x": 1}]] * 3, "n": [1] * 1000}
    raw = json.dumps(doc).encode()
    assert b"\\ud83d\\ude00" in raw and decode_json(raw, LIMITS) == doc  # a surrogate *pair* is valid
    assert decode_json(b"", LIMITS) == {}
    assert decode_json(b"[" * 64 + b"]" * 64, LIMITS) == eval("[" * 64 + "]" * 64)  # at the depth limit


def test_user_metadata_bounds():
    limits = Limits(max_metadata_bytes=100, max_metadata_keys=5, max_metadata_depth=2)
    limits.check_user_metadata(None)
    limits.check_user_metadata({"a": {"b": "c"}, "n": [1, 2]})
    for meta, words in [({"k": "x" * 200}, "max_metadata_bytes=100"),
                        ({f"k{i}": 1 for i in range(6)}, "has 6 keys"),
                        ({"a": {"b": {"c": 1}}}, "user_metadata.a.b: nested deeper than 2"),
                        ({"a": "\udcff"}, "user_metadata.a: holds a lone"),
                        ({"a": object()}, "JSON values only"),
                        (["x"], "must be a JSON object")]:
        with pytest.raises(UserError, match=words.replace("[", r"\[").replace(".", r"\.")):
            limits.check_user_metadata(meta)


def test_check_json_tree_counts_keys_without_recursion():
    doc: dict = {"a": 1}
    for _ in range(50_000):  # far deeper than Python's recursion limit
        doc = {"a": doc}
    assert check_json_tree({"a": 1, "b": {"c": 2}}, 10) == 3
    with pytest.raises(UserError, match=r"nested deeper than 40000 levels \(x=40000\)"):
        check_json_tree(doc, 40_000, limit_name="x")
    assert check_json_tree(doc, 60_000) == 50_001


def fb_request(shape: list[int], dtype=pb.DTYPE_INT64) -> pb.ForwardBackwardRequest:
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.ones(shape[0], "<i4").tobytes()
    t = datum.loss_fn_inputs["target_tokens"]
    t.dtype, t.sparse_csr.crow_indices = dtype, np.zeros(shape[0] + 1, "<i8").tobytes()
    t.shape.extend(shape)
    return msg


def test_sparse_densification_is_bounded_in_bytes():
    """The issue's 114-byte forward: [1, 67108864] int64 is 512 MB dense, 8x a 64 MB body."""
    body = fb_request([1, 67108864]).SerializeToString()
    with pytest.raises(wire.WireError, match=r"536870912 bytes; the limit is 67108864 \(the body limit\)"):
        wire.decode_forward_backward_request(body, max_dense_values=64 << 20, max_dense_bytes=64 << 20)
    ok = wire.decode_forward_backward_request(fb_request([2, 1000]).SerializeToString(), max_dense_bytes=16_000).request
    assert ok.data[0].loss_fn_inputs["target_tokens"].shape == [2, 1000]


def test_protobuf_fields_are_counted_before_parsing():
    assert wire.decode_forward_backward_request(fb_request([3, 2]).SerializeToString(), max_fields=20).request.model_id == "m"
    with pytest.raises(wire.WireError, match="max_protobuf_fields=1000"):
        wire.decode_forward_backward_request(b"\x0a\x00" * 5000, max_fields=1000)  # 5,000 model_ids
    with pytest.raises(wire.WireError, match="max_protobuf_fields=1000"):
        wire.decode_forward_backward_request(b"\x1a\x02\x0a\x00" * 1000, max_fields=1000)  # datums and chunks
    with pytest.raises(wire.WireError, match="not a valid"):  # malformed: left to the parser to name
        wire.decode_forward_backward_request(b"\x1a\xff\xff\xff\xff\x0f" + b"\x00" * 3000, max_fields=1000)


def test_top_k_targets_are_bounded_by_the_vocabulary():
    targets = torch.zeros(3, 11, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"K=11 top-K targets per position, more than the vocabulary \(K <= vocab_size=10\)"):
        validate_datum_inputs("cross_entropy", 0, 3, {"target_tokens": targets}, vocab_size=10)
    sparse = torch.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                     (3, 2**40))  # never densified
    with pytest.raises(ValueError, match="more values than model_input length x vocab_size = 3 x 10"):
        validate_datum_inputs("cross_entropy", 0, 3, {"target_tokens": sparse}, vocab_size=10)
    out = validate_datum_inputs("cross_entropy", 0, 3, {"target_tokens": targets[:, :10]}, vocab_size=10)
    assert out["weights"].shape == (3, 10)


@pytest.mark.parametrize("body, words", [
    ({"n": 256, "logprobs": True, "top_logprobs": 100, "max_tokens": 1015}, "max_openai_n=128"),
    ({"n": 1, "logprobs": True, "top_logprobs": 21}, "max_openai_top_logprobs=20"),
    ({"n": 16, "logprobs": True, "top_logprobs": 20, "max_tokens": 1015}, "max_openai_logprob_entries=262144"),
])
def test_openai_sizes_are_bounded_before_sampling(body, words):
    req = oa.ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "a"}], **body})
    with pytest.raises(oa.Unsupported, match=words):
        req.check_limits(LIMITS, req.sampling_params(oa.DEFAULT_CHAT_MAX_TOKENS))
    fine = oa.ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "a"}], "n": 16,
                                         "max_tokens": 400, "logprobs": True, "top_logprobs": 20})
    fine.check_limits(LIMITS, fine.sampling_params(oa.DEFAULT_CHAT_MAX_TOKENS))  # 134,400 entries: allowed


def test_openai_answers_are_encoded_in_pieces_equal_to_json_dumps():
    entry = {"token": "ü", "logprob": -0.5, "bytes": [195, 188], "top_logprobs": [{"token": "a", "logprob": -1.0}] * 5}
    answer = {"id": "x", "choices": [{"index": i, "logprobs": {"content": [entry] * 300}} for i in range(3)],
              "usage": {"total_tokens": 9}, "empty": [], "none": None}
    pieces = list(json_pieces(answer))
    assert json.loads(b"".join(pieces)) == answer
    assert max(len(p) for p in pieces) < 64 * len(json.dumps(entry)) + 100  # no piece holds a whole choice
    with pytest.raises(ValueError):
        b"".join(json_pieces({"choices": [{"logprob": -math.inf}]}))
