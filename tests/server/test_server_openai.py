"""The OpenAI-compatible routes (`/v1/...`) against `ember serve`, with the official `openai`
client: completions and chat completions from a base model and from a trained checkpoint,
tokens and logprobs equal to the tinker SDK's sampler, isolation and OpenAI-shaped errors."""

from __future__ import annotations

import httpx
import openai
import pytest
from tinker import types

from ember.models import load_tokenizer
from helpers.server import API_KEY, MODEL_NAME, OTHER_KEY, sft_datum

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

PROMPT_TEXT = "Hello, what is 2+2?"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def oai(ember_server):
    return openai.OpenAI(base_url=ember_server.base_url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def checkpoint(sc):
    """A LoRA run after two optimizer steps, saved for sampling."""
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=3).result()
    for _ in range(2):
        tc.forward_backward([sft_datum([5, 17, 30, 42, 8, 61, 9])], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return tc.save_weights_for_sampler("oai").result().path


def sdk_sample(sampler, prompt_ids, *, max_tokens, seed, temperature=0.0, k=0):
    params = types.SamplingParams(max_tokens=max_tokens, seed=seed, temperature=temperature)
    return sampler.sample(types.ModelInput.from_ints(prompt_ids), 1, params,
                          topk_sample_logprobs=k or None).result().sequences[0]


def check_completion(oai, sampler, tok, model):
    resp = oai.completions.create(model=model, prompt=PROMPT_TEXT, max_tokens=10, temperature=0, seed=5,
                                  logprobs=3)
    ids = tok.encode(PROMPT_TEXT, add_special_tokens=False)
    want = sdk_sample(sampler, ids, max_tokens=10, seed=5, k=3)
    choice = resp.choices[0]
    assert choice.logprobs.tokens == [tok.decode([t]) for t in want.tokens]
    assert choice.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert choice.text == tok.decode(want.tokens, skip_special_tokens=True)
    assert choice.finish_reason == ("length" if want.stop_reason == "length" else "stop")
    for top, row in zip(choice.logprobs.top_logprobs, want.topk_logprobs, strict=True):
        assert sorted(top.values(), reverse=True) == pytest.approx(sorted((lp for _, lp in row), reverse=True),
                                                                   abs=1e-5)
    assert choice.logprobs.text_offset[0] == len(PROMPT_TEXT)
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == len(want.tokens)
    # token-id prompts are taken as they are
    by_ids = oai.completions.create(model=model, prompt=ids, max_tokens=10, temperature=0, logprobs=0)
    assert by_ids.choices[0].logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-5)


def check_chat(oai, sampler, tok, model):
    resp = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0, seed=1,
                                       logprobs=True, top_logprobs=2)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    want = sdk_sample(sampler, ids, max_tokens=8, seed=1, k=2)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == tok.decode(want.tokens, skip_special_tokens=True)
    assert [c.token for c in choice.logprobs.content] == [tok.decode([t]) for t in want.tokens]
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(want.logprobs, abs=1e-5)
    assert all(len(c.top_logprobs) == 2 for c in choice.logprobs.content)
    assert resp.usage.prompt_tokens == len(ids)


def test_base_model_completions_and_chat_equal_the_sampler(sc, oai, tok):
    sampler = sc.create_sampling_client(base_model=MODEL_NAME).result()
    check_completion(oai, sampler, tok, MODEL_NAME)
    check_chat(oai, sampler, tok, MODEL_NAME)


def test_checkpoint_completions_and_chat_equal_the_sampler(sc, oai, tok, checkpoint):
    sampler = sc.create_sampling_client(model_path=checkpoint).result()
    check_completion(oai, sampler, tok, checkpoint)
    check_chat(oai, sampler, tok, checkpoint)
    base = oai.completions.create(model=MODEL_NAME, prompt=PROMPT_TEXT, max_tokens=4, temperature=0, logprobs=0)
    trained = oai.completions.create(model=checkpoint, prompt=PROMPT_TEXT, max_tokens=4, temperature=0, logprobs=0)
    assert base.choices[0].logprobs.token_logprobs != trained.choices[0].logprobs.token_logprobs


def test_n_samples_and_stop(oai):
    resp = oai.completions.create(model=MODEL_NAME, prompt=PROMPT_TEXT, max_tokens=6, n=3, temperature=1.0, seed=2)
    assert len(resp.choices) == 3 and [c.index for c in resp.choices] == [0, 1, 2]
    assert all(c.logprobs is None for c in resp.choices)


def test_models_lists_the_base_models_and_only_the_callers_checkpoints(oai, ember_server, checkpoint):
    ids = [m.id for m in oai.models.list().data]
    assert MODEL_NAME in ids and checkpoint in ids
    other = openai.OpenAI(base_url=ember_server.base_url + "/v1", api_key=OTHER_KEY, max_retries=0)
    other_ids = [m.id for m in other.models.list().data]
    assert MODEL_NAME in other_ids and checkpoint not in other_ids


def test_another_key_cannot_use_the_checkpoint(ember_server, checkpoint):
    other = openai.OpenAI(base_url=ember_server.base_url + "/v1", api_key=OTHER_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        other.completions.create(model=checkpoint, prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        other.chat.completions.create(model=checkpoint, messages=MESSAGES, max_tokens=2)


@pytest.mark.parametrize("kwargs, status", [
    (dict(model=MODEL_NAME, prompt="hi", max_tokens=-1), 400),
    (dict(model=MODEL_NAME, prompt="hi", max_tokens=10**9), 400),
    (dict(model=MODEL_NAME, prompt="hi", logprobs=10**6), 400),
    (dict(model="no/such-model", prompt="hi"), 404),
    (dict(model="tinker://nope:train:0/sampler_weights/x", prompt="hi"), 404),
    (dict(model=MODEL_NAME, prompt="hi", stream_options={"include_usage": True}), 400),  # needs stream=true
    (dict(model=MODEL_NAME, prompt="hi", echo=True), 400),
    (dict(model=MODEL_NAME, prompt=["a", "b"]), 400),
    (dict(model=MODEL_NAME, prompt="hi", temperature="hot"), 400),
])
def test_bad_input_is_an_openai_error(ember_server, kwargs, status):
    r = httpx.post(ember_server.base_url + "/v1/completions", json=kwargs,
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert isinstance(body["message"], str) and body["message"] and "type" in body and "code" in body


def test_a_streamed_completion_is_the_same_answer_as_events(oai):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT_TEXT, max_tokens=10, temperature=0, seed=5, logprobs=2)
    whole = oai.completions.create(**kwargs)
    chunks = list(oai.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    streamed_lps = [lp for c in chunks if c.choices and c.choices[0].logprobs
                    for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed_lps == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()  # usage last
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(oai.completions.create(**kwargs, stream=True))  # no usage unless asked
    assert plain and all(c.usage is None and c.choices for c in plain)


def test_a_streamed_chat_answer_has_the_role_content_and_finish(oai):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0, seed=1, n=2)
    whole = oai.chat.completions.create(**kwargs)
    chunks = list(oai.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert "".join(ch.delta.content or "" for ch in mine) == whole.choices[i].message.content
        assert mine[-1].finish_reason == whole.choices[i].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert {c.object for c in chunks} == {"chat.completion.chunk"}


def test_auth_errors_use_the_openai_shape(ember_server):
    bad = openai.OpenAI(base_url=ember_server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.models.list()
    assert err.value.body["type"] == "authentication_error"


def test_stop_string_ends_the_text(oai):
    free = oai.completions.create(model=MODEL_NAME, prompt=PROMPT_TEXT, max_tokens=12, temperature=0, logprobs=0)
    text = free.choices[0].text
    assert free.choices[0].finish_reason == "length" and len(text) >= 4
    stop = text[2:4]
    cut = oai.completions.create(model=MODEL_NAME, prompt=PROMPT_TEXT, max_tokens=12, temperature=0, stop=[stop],
                                 logprobs=0)
    choice = cut.choices[0]
    assert choice.finish_reason == "stop" and choice.text == text[: text.index(stop)]
    assert "".join(choice.logprobs.tokens).startswith(text[: text.index(stop)])


def test_x_api_key_header_works_too(ember_server):
    r = httpx.post(ember_server.base_url + "/v1/chat/completions", headers={"X-API-Key": API_KEY}, timeout=60,
                   json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] <= 3
