"""Bounded work (hardening item 2): every count and size a request carries is refused as a
user error naming the field and the limit before anything is allocated or awaited; the
server's memory does not grow, and the next normal request is served.

The server runs under an address-space cap (`memory_cap`), so a limit that failed to hold
would fail an allocation instead of growing a shared machine's memory.
"""

from __future__ import annotations

import time

import httpx
import psutil
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from helpers.server import API_KEY, MODEL_NAME, future_outcome, memory_cap, sft_datum, start_server

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

LIMITS = {
    "max_num_samples": 16, "max_sample_tokens": 64, "max_prompt_tokens": 64, "max_topk_logprobs": 5,
    "max_datums_per_request": 8, "max_datum_tokens": 64, "max_request_tokens": 200, "max_seq_ahead": 8,
    "max_lora_rank": 16,
}
RSS_BOUND = 64 << 20  # no hostile request below may grow the server by more than this


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    flags = [a for k, v in LIMITS.items() for a in (f"--limits.{k}", str(v))]
    srv = start_server(tiny_model_dir, tmp_path_factory.mktemp("limits"), extra_args=flags,
                       wrap=memory_cap(12 << 30))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url + "/api/v1", headers={"X-API-Key": API_KEY}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(server):
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    yield sc, tc, sampler
    sc.close("success").result(timeout=30)


def rss(server) -> int:
    return psutil.Process(server.proc.pid).memory_info().rss


def refused(http: httpx.Client, path: str, body: dict | bytes, *words: str) -> None:
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/x-protobuf"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == 200, r.text  # accepted, then failed as the user's error
    out = future_outcome(http, r.json()["request_id"])
    assert out.get("category") == "user", out
    for w in words:
        assert w in out["error"], out["error"]


def sample_body(sampler_id: str, *, num_samples=1, max_tokens=4, prompt_len=3, topk_prompt=0, topk_sample=0,
                alt_k=0) -> dict:
    req = types.SampleRequest(
        sampling_session_id=sampler_id, num_samples=num_samples, prompt=types.ModelInput.from_ints([5] * prompt_len),
        sampling_params=types.SamplingParams(max_tokens=max_tokens), topk_prompt_logprobs=topk_prompt,
        topk_sample_logprobs=topk_sample, prompt_logprobs=bool(topk_prompt), prompt_alt_tokens_k=alt_k)
    return req.model_dump(mode="json", exclude_none=True)


def fb_body(model_id: str, seq_id: int, data) -> bytes:
    """A forward_backward body as the SDK sends it (protobuf)."""
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id)
    return forward_backward_request_to_proto(req).SerializeToString()


def assert_still_serves(sdk) -> None:
    _, tc, sampler = sdk
    tc.forward_backward([sft_datum([1, 2, 3, 4])], "cross_entropy").result(timeout=60)
    out = sampler.sample(types.ModelInput.from_ints([1, 2]), 2, types.SamplingParams(max_tokens=3)).result(timeout=60)
    assert len(out.sequences) == 2


@pytest.mark.parametrize("sampler_kind", ["real", "unknown"])
@pytest.mark.parametrize("kwargs, words", [
    (dict(num_samples=10**12), ["num_samples=1000000000000", "max_num_samples"]),
    (dict(num_samples=17), ["num_samples=17", "max 16"]),
    (dict(max_tokens=10**9), ["sampling_params.max_tokens=1000000000", "max_sample_tokens"]),
    (dict(prompt_len=65), ["prompt has 65 tokens", "max_prompt_tokens=64"]),
    (dict(topk_prompt=10**6), ["topk_prompt_logprobs=1000000", "max_topk_logprobs"]),
    (dict(topk_sample=6), ["topk_sample_logprobs=6", "max 5"]),
    (dict(alt_k=10**6), ["prompt_alt_tokens_k=1000000", "max_topk_logprobs"]),
])
def test_sample_counts_over_a_limit_are_refused_before_allocation(server, http, sdk, sampler_kind, kwargs, words):
    """A huge num_samples aimed at a sampler id that does not exist once grew the server to
    the OOM killer: now the limit is checked before the future reserves sequence ids."""
    sampler_id = sdk[2]._sampling_session_id if sampler_kind == "real" else "sess-nope:sample:0"
    before = rss(server)
    refused(http, "/asample", sample_body(sampler_id, **kwargs), *words)
    assert rss(server) - before < RSS_BOUND
    assert_still_serves(sdk)


def test_datum_counts_and_lengths_over_a_limit_are_refused(server, http, sdk):
    model_id = sdk[1].get_info().model_id
    before = rss(server)
    cases = [
        ([sft_datum([1, 2, 3])] * 9, ["data has 9 datums", "max_datums_per_request=8"]),
        ([sft_datum([1, 2]), sft_datum([3] * 66)], ["data[1].model_input has 65 tokens", "max_datum_tokens=64"]),
        ([sft_datum([3] * 51)] * 5, ["250 model_input tokens", "max_request_tokens=200"]),
    ]
    for data, words in cases:
        # any seq_id: refused before the run's queue is consulted
        refused(http, "/forward_backward", fb_body(model_id, 10**6, data), *words)
    assert rss(server) - before < RSS_BOUND
    assert_still_serves(sdk)


def test_a_seq_id_far_ahead_is_refused_not_left_waiting(server, http, sdk):
    """Once queued, a far-ahead request would wait for the gap timeout and then skip every
    request in between; now it is refused at once, and the run's order is intact."""
    tc = sdk[1]
    model_id = tc.get_info().model_id
    tc.forward_backward([sft_datum([1, 2, 3])], "cross_entropy").result(timeout=60)
    start = time.monotonic()
    refused(http, "/forward_backward", fb_body(model_id, 10**9, [sft_datum([1, 2, 3])]),
            f"seq_id {10**9}", "max_seq_ahead=8")
    assert time.monotonic() - start < 4.0  # not after the 5 s gap timeout
    assert_still_serves(sdk)  # the SDK's next seq_id is still the one the run expects


def test_limits_reach_the_capabilities(server, sdk):
    caps = sdk[0].create_rest_client().get_server_capabilities().result()
    (model,) = [m for m in caps.supported_models if m.model_name == MODEL_NAME]
    assert model.max_context_length == LIMITS["max_datum_tokens"]  # the tiny model has more positions


def test_a_lora_rank_over_the_limit_is_refused(server, sdk):
    """An unbounded rank once reached peft ("can't allocate 549 GB") as a server fault."""
    sc = sdk[0]
    before = rss(server)
    for rank in (17, 2**31 - 1, 10**20):
        with pytest.raises(Exception, match=f"lora_config.rank={rank} is over the limit max 16"):
            sc.create_lora_training_client(base_model=MODEL_NAME, rank=rank).result()
    assert rss(server) - before < RSS_BOUND
    assert_still_serves(sdk)


def test_top_k_and_logprob_counts_beyond_the_vocabulary_are_clamped(sdk):
    """top_k = 10**20 once overflowed in the sampler's slots; past the vocabulary it keeps
    every token, i.e. it is off: the same tokens and logprobs as top_k=-1."""
    sampler = sdk[2]
    prompt = types.ModelInput.from_ints([3, 4, 5])
    outs = [sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, seed=7, top_k=k)).result(timeout=60)
            for k in (-1, 10**20)]
    for a, b in zip(outs[0].sequences, outs[1].sequences, strict=True):
        assert a.tokens == b.tokens and a.logprobs == b.logprobs
