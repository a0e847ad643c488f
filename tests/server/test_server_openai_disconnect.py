"""`stream=true` as the sampler decodes, against a real `ember serve` with one sampler slot
and the official `openai` client: the first chunk arrives while the request still holds its
slot (`ember_sampler_active_sequences` on /metrics), a client that hangs up frees the slot
(its sample is cancelled, never completed), a client gone while its request waits for\nthe slot leaves the queue, and the next request gets the slot."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from helpers.server import API_KEY, MODEL_NAME, start_server, wait_until

pytestmark = pytest.mark.slow  # an `ember serve` of its own

LONG = 900  # greedy, the tiny model never draws EOS: a request that holds the slot for many steps
# A long request also carries a stop string that never matches: the server's fail point sleeps at each
# of its decode steps, so it holds the slot for >= 900 x 50 ms however fast the host (an idle host
# decoded all 900 tokens before a hung-up client's cancellation was seen).
NEVER = ["\u00a7never-stop\u00a7"]
SLOW_STEPS = {"EMBER_FAILPOINTS": "sampler.stop_strings=sleep:0.05"}


@pytest.fixture(scope="module")
def one_slot_server(tiny_model_dir, tmp_path_factory):
    server = start_server(Path(tiny_model_dir), tmp_path_factory.mktemp("openai-one-slot"),
                          extra_args=["--sampler.max_slots", "1"], env=SLOW_STEPS)
    yield server
    server.stop()


def scrape(base_url: str) -> dict[str, float]:
    """{name{labels}: value} of the sampler and sample-future lines of /metrics."""
    text = httpx.get(f"{base_url}/metrics", headers={"X-API-Key": API_KEY}, timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith(("ember_sampler_", "ember_sampled_tokens_total", "ember_futures_finished_total")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def active(base_url: str) -> float:
    return scrape(base_url)[f'ember_sampler_active_sequences{{model="{MODEL_NAME}"}}']


def failed_samples(metrics: dict[str, float]) -> float:
    return metrics.get('ember_futures_finished_total{request_type="Sample",state="failed"}', 0.0)


def test_chunks_come_while_decoding_and_a_hang_up_frees_the_slot(one_slot_server):
    base = one_slot_server.base_url
    oai = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    kwargs = dict(model=MODEL_NAME, prompt="Hello", temperature=0, seed=1)
    oai.completions.create(**kwargs, max_tokens=2)  # the sampler is loaded: its gauge exists
    before = scrape(base)
    stream = oai.completions.create(**kwargs, max_tokens=LONG, stop=NEVER, stream=True)
    first = next(iter(stream))
    assert first.choices[0].finish_reason is None and first.choices[0].text
    assert active(base) == 1  # the request is still decoding: the chunk came before its last token
    stream.close()  # the client hangs up

    wait_until(lambda: active(base) == 0, timeout=120, message="the slot freed after the hang-up")
    after = scrape(base)
    assert failed_samples(after) == failed_samples(before) + 1  # cancelled, not run to its end
    assert after["ember_sampled_tokens_total"] == before["ember_sampled_tokens_total"]

    # The only slot serves the next request, streamed with its usage last.
    whole = oai.completions.create(**kwargs, max_tokens=6)
    chunks = list(oai.completions.create(**kwargs, max_tokens=6, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    assert active(base) == 0 and scrape(base)[f'ember_sampler_waiting_requests{{model="{MODEL_NAME}"}}'] == 0


def test_a_client_gone_before_its_first_token_leaves_the_queue(one_slot_server):
    """A stream waiting behind the only slot, whose client hangs up before any token, is
    cancelled while it waits (the route watches the connection), not when the slot frees."""
    base = one_slot_server.base_url
    oai = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    kwargs = dict(model=MODEL_NAME, prompt="Hello", temperature=0, seed=1)
    holder = oai.completions.create(**kwargs, max_tokens=LONG, stop=NEVER, stream=True)
    next(iter(holder))  # the only slot is taken until this stream ends
    before = failed_samples(scrape(base))
    body = dict(kwargs, max_tokens=4, stream=True)
    try:  # no header comes before a first token: the client gives up waiting and hangs up
        r = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                       timeout=httpx.Timeout(60, read=3))
    except httpx.ReadTimeout:
        pass
    else:
        pytest.fail(f"the queued stream answered before the slot freed: {r.status_code} {r.text[:300]!r}")
    wait_until(lambda: failed_samples(scrape(base)) == before + 1, timeout=120,
               message="the waiting sample cancelled after its client hung up")
    assert active(base) == 1  # while the holder still decodes
    holder.close()
    wait_until(lambda: active(base) == 0, timeout=120, message="the holder's slot freed")
    assert scrape(base)[f'ember_sampler_waiting_requests{{model="{MODEL_NAME}"}}'] == 0


def test_a_chat_stream_sends_text_before_it_ends(one_slot_server):
    oai = openai.OpenAI(base_url=one_slot_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    stream = oai.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=LONG, stop=NEVER, temperature=0, stream=True)
    seen = []
    for chunk in stream:
        seen.append(chunk.choices[0])
        if chunk.choices[0].delta.content:
            break
    assert seen[0].delta.role == "assistant" and all(c.finish_reason is None for c in seen)
    assert active(one_slot_server.base_url) == 1
    stream.close()
    wait_until(lambda: active(one_slot_server.base_url) == 0, timeout=120, message="the slot freed")


def test_a_stream_without_tokens_still_ends_with_finish_and_usage(one_slot_server):
    oai = openai.OpenAI(base_url=one_slot_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    chunks = list(oai.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=0, stream=True,
                                         stream_options={"include_usage": True}))
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == ["length"]
    assert chunks[-1].usage.completion_tokens == 0
