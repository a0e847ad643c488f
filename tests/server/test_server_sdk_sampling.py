"""docs/protocol.md §9 sampling items 21-27: the unmodified official SDK against
`ember serve`, protobuf SampleResponse, sample_sequence_ids, snapshots."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types

from helpers.server import MODEL_NAME, sft_datum

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

PROMPT = types.ModelInput.from_ints([5, 17, 30, 42, 8, 61])


@pytest.fixture(scope="module")
def trained(sc):
    """A LoRA run with one optimizer step, its sampler, and its tokenizer."""
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=2).result()
    tc.forward_backward([sft_datum([5, 17, 30, 42, 8, 61, 9])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return tc, tc.save_weights_and_get_sampling_client().result(), tc.get_tokenizer()


def params(**kw) -> types.SamplingParams:
    return types.SamplingParams(**{"max_tokens": 12, "seed": 7, "temperature": 1.0, **kw})


def test_save_weights_and_get_sampling_client_and_sequence_ids(ember_server, trained):
    tc, sampler, _ = trained
    save = [e for e in ember_server.requests("/save_weights_for_sampler")
            if e["json"].get("model_id") == tc.get_info().model_id][-1]
    assert "path" not in save["json"] and isinstance(save["json"]["sampling_session_seq_id"], int)
    result_poll = [e for e in ember_server.requests("/retrieve_future")
                   if e["json"].get("request_id") == save["response"]["request_id"] and e["extra"].get("status") == "complete"]
    assert isinstance(result_poll[-1]["response"]["sampling_session_id"], str)
    mark = ember_server.log_mark()
    resp = sampler.sample(PROMPT, num_samples=3, sampling_params=params(stop=[])).result()
    submitted = ember_server.requests_since(mark, "/asample")[0]
    assert [s.sequence_id for s in resp.sequences] == submitted["response"]["sample_sequence_ids"]
    assert len(set(submitted["response"]["sample_sequence_ids"])) == 3
    for seq in resp.sequences:
        assert seq.stop_reason in ("stop", "length") and len(seq.tokens) == 12
        assert len(seq.logprobs) == len(seq.tokens) and all(lp <= 0 for lp in seq.logprobs)
    fetched = [e for e in ember_server.requests_since(mark, "/retrieve_future") if e["extra"].get("status") == "complete"]
    assert fetched[-1]["response_type"] == "application/x-protobuf"


def test_stop_tokens_and_strings(trained):
    _, sampler, tok = trained
    free = sampler.sample(PROMPT, 1, params(max_tokens=20, stop=[])).result().sequences[0]
    assert free.stop_reason == "length" and len(free.tokens) == 20
    stop_tok = free.tokens[4]
    cut = free.tokens[: free.tokens.index(stop_tok) + 1]
    by_id = sampler.sample(PROMPT, 1, params(max_tokens=20, stop=[stop_tok])).result().sequences[0]
    assert by_id.stop_reason == "stop" and by_id.tokens == cut  # stop token included
    text = tok.decode([stop_tok])
    for stop in ([text], text):
        by_str = sampler.sample(PROMPT, 1, params(max_tokens=20, stop=stop)).result().sequences[0]
        assert by_str.stop_reason == "stop" and tok.decode(by_str.tokens).endswith(text)
        assert by_str.tokens == cut
    implicit = sampler.sample(PROMPT, 2, params(max_tokens=6, stop=None)).result().sequences
    for seq in implicit:
        assert (seq.stop_reason, len(seq.tokens)) == ("length", 6) or seq.tokens[-1] == tok.eos_token_id


def test_seed_temperature_top_k_top_p(trained):
    _, sampler, _ = trained

    def toks(**kw):
        return sampler.sample(PROMPT, 1, params(**kw)).result().sequences[0].tokens

    assert toks(seed=3) == toks(seed=3)
    assert len({tuple(toks(seed=s)) for s in range(4)}) > 1
    greedy = toks(temperature=1e-4, seed=1)
    assert toks(temperature=1e-4, seed=2) == greedy
    assert toks(top_k=1, seed=5) == greedy
    assert toks(top_p=1e-6, seed=6) == greedy


def test_prompt_logprobs_topk_and_compute_logprobs(trained):
    tc, sampler, _ = trained
    resp = sampler.sample(PROMPT, 1, params(max_tokens=3), include_prompt_logprobs=True,
                          topk_prompt_logprobs=2, topk_sample_logprobs=3).result()
    plp = resp.prompt_logprobs
    assert len(plp) == PROMPT.length and plp[0] is None and all(isinstance(x, float) for x in plp[1:])
    topk = resp.topk_prompt_logprobs
    assert topk[0] is None and all(len(row) == 2 for row in topk[1:])
    seq = resp.sequences[0]
    assert len(seq.topk_logprobs) == len(seq.tokens) and all(len(row) == 3 for row in seq.topk_logprobs)
    computed = sampler.compute_logprobs(PROMPT).result()
    assert computed[0] is None
    np.testing.assert_allclose(computed[1:], plp[1:], rtol=1e-5, atol=1e-5)
    # trainer/sampler agreement (docs/architecture.md contract 5): same weights, same logprobs
    ids = PROMPT.to_ints()
    trainer = tc.forward([sft_datum(ids)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    np.testing.assert_allclose(computed[1:], trainer, atol=1e-4)


def test_prompt_logprobs_last_n(trained):
    _, sampler, _ = trained
    resp = sampler.sample(PROMPT, 1, params(max_tokens=1), include_prompt_logprobs=True,
                          prompt_logprobs_last_n=2).result()
    plp = resp.prompt_logprobs
    assert plp[:-2] == [None] * (PROMPT.length - 2) and all(isinstance(x, float) for x in plp[-2:])


def test_create_sampling_client_from_base_model_and_path(ember_server, sc, trained):
    tc, _, _ = trained
    base = sc.create_sampling_client(base_model=MODEL_NAME).result()
    assert base.get_base_model() == MODEL_NAME
    path = tc.save_weights_for_sampler("sampler-001").result().path
    assert path == f"tinker://{tc.get_info().model_id}/sampler_weights/sampler-001"
    mark = ember_server.log_mark()
    from_path = sc.create_sampling_client(model_path=path).result()
    assert from_path.get_base_model() == MODEL_NAME
    got = ember_server.requests_since(mark, "/samplers/" + ember_server.requests_since(
        mark, "/create_sampling_session")[0]["response"]["sampling_session_id"])
    assert got and got[0]["method"] == "GET" and got[0]["response"]["base_model"] == MODEL_NAME
    trained_lp = from_path.compute_logprobs(PROMPT).result()[1:]
    base_lp = base.compute_logprobs(PROMPT).result()[1:]
    assert np.abs(np.array(trained_lp) - np.array(base_lp)).max() > 1e-3


def test_sampler_is_a_snapshot(sc):
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=9).result()
    old = tc.save_weights_and_get_sampling_client().result()
    before = old.compute_logprobs(PROMPT).result()
    tc.forward_backward([sft_datum(PROMPT.to_ints() + [3])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert old.compute_logprobs(PROMPT).result() == before
    new = tc.save_weights_and_get_sampling_client().result().compute_logprobs(PROMPT).result()
    assert np.abs(np.array(new[1:]) - np.array(before[1:])).max() > 1e-3


def test_inflight_sampling_clients_follow_the_newest_inflight_save(ember_server, sc):
    """kind="inflight" over HTTP (tinker.types.SamplingClientKind): the SDK sends the kind, and a
    client made by an earlier in-flight save samples the newest one from its next request on."""
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=9).result()
    mark = ember_server.log_mark()
    first = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    assert ember_server.requests_since(mark, "/save_weights_for_sampler")[0]["json"]["kind"] == "inflight"
    before = first.compute_logprobs(PROMPT).result()
    tc.forward_backward([sft_datum(PROMPT.to_ints() + [3])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert first.compute_logprobs(PROMPT).result() == before  # not published yet
    second = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    after = np.array(second.compute_logprobs(PROMPT).result()[1:])
    assert np.abs(after - np.array(before[1:])).max() > 1e-3
    np.testing.assert_allclose(np.array(first.compute_logprobs(PROMPT).result()[1:]), after, rtol=0, atol=1e-6)


def test_sampler_handle_reconnects_for_its_owner_only(ember_server, trained):
    """get_sampler_handle / SamplingClient.from_sampler_handle (SDK-side, carrying no
    credentials): the owner's key samples the same weights again; another key gets 404."""
    import tinker

    from helpers.server import API_KEY, OTHER_KEY

    _, sampler, _ = trained
    handle = sampler.get_sampler_handle()
    prompt = types.ModelInput.from_ints([5, 17, 30])
    p = params(max_tokens=4, temperature=0.0)
    again = tinker.SamplingClient.from_sampler_handle(handle, api_key=API_KEY)
    stranger = tinker.SamplingClient.from_sampler_handle(handle, api_key=OTHER_KEY)
    try:
        assert again.sample(prompt, 1, p).result().sequences[0].tokens == \
            sampler.sample(prompt, 1, p).result().sequences[0].tokens
        with pytest.raises((tinker.NotFoundError, tinker.RequestFailedError)):
            stranger.sample(prompt, 1, p).result(timeout=60)
    finally:  # each handle client heartbeats the session on its own (the stranger's for ever: 404s)
        again.holder.close()
        stranger.holder.close()
