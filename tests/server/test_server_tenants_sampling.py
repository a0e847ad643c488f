"""Two tenants (API keys) sampling one base model through the official SDK against a real
`ember serve`, on both sampler backends (issue 24):

* the prefix cache answers only for its owner: B guessing A's secret gets the same
  `prompt_cache_hit_tokens` for every guess, while A's own repeat still hits;
* fair shares: A's 4-token sample completes within 2 s while B has 20 x (n=256,
  max_tokens=300) sent and at least 12 of them still queued when A is answered (a fast host
  answers a few); B's backlog beyond `--limits.max_queued_sample_tokens_per_key` is refused
  as a user error (of 12 more requests, one is over the bound while at most 10 of B's 20
  have been answered);
* bad input is a user error: a lone surrogate in a stop string, a value head's checkpoint
  as a sampler, the sampler evicted by the 33rd of a session (torch only: the service
  layer is the same for both backends).

The fairness test leaves B's backlog queued, so each backend's server is this module's
own and the refusal test runs after it."""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from helpers.server import (API_KEY, MODEL_NAME, OTHER_KEY, future_outcome, memory_cap, sft_datum, start_server,
                            wait_until)

BACKENDS = [
    pytest.param("torch", marks=pytest.mark.slow),
    pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.needs_vllm]),
]
ARGS = {
    "torch": ["--sampler.max_len", "512"],
    "vllm": ["--sampler.backend", "vllm", "--sampler.max_len", "512", "--limits.max_lora_rank", "8",
             "--sampler.max_slots", "16"],
}
QUEUED_TOKENS = 1_700_000  # B's 20 x 256 x (8 + 300) = 1,576,960 fit; 1 more fits, 2 do not
PREFIX = [(7 * i + 3) % 60 + 1 for i in range(128)]  # "My password is" (a long shared prefix)
SUFFIX = [(11 * i + 5) % 60 + 1 for i in range(255)]  # "... and nobody knows it"
SECRET = 7  # A's "hunter7"


@pytest.fixture(scope="module", params=BACKENDS)
def server(request, tiny_model_dir, tiny_vllm_model_dir, tmp_path_factory):
    backend = request.param
    model = tiny_model_dir if backend == "torch" else tiny_vllm_model_dir
    srv = start_server(Path(model), tmp_path_factory.mktemp(f"ember-tenants-{backend}"), wrap=memory_cap(16 << 30),
                       extra_args=[*ARGS[backend], "--limits.max_queued_sample_tokens_per_key", str(QUEUED_TOKENS)])
    srv.backend = backend
    yield srv
    srv.stop(timeout=60)


@pytest.fixture(scope="module")
def tenants(server):
    a = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    b = tinker.ServiceClient(base_url=server.base_url, api_key=OTHER_KEY)
    yield a, b
    for client in (a, b):
        try:
            client.close("success").result(timeout=30)
        except Exception:  # noqa: BLE001 - the server may be busy with B's backlog
            pass


def _sampler(client, **kw):
    return client.create_sampling_client(**(kw or {"base_model": MODEL_NAME})).result(timeout=120)


def _hits(sampler, guess: int) -> int:
    prompt = types.ModelInput.from_ints(PREFIX + [guess] + SUFFIX)
    out = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1, temperature=0.0)).result(timeout=600)
    return out.prompt_cache_hit_tokens or 0


def test_prefix_cache_hit_counts_reflect_only_the_callers_own_prompts(tenants):
    a, b = tenants
    a_sampler, b_sampler = _sampler(a), _sampler(b)
    _hits(a_sampler, SECRET)  # A samples "My password is hunter7 ..."
    _hits(b_sampler, 59)  # B's own warm-up: it may reuse the prefix it computed itself
    guesses = {guess: _hits(b_sampler, guess) for guess in range(10)}
    assert len(set(guesses.values())) == 1, guesses  # hunter7 reads exactly like every other guess
    assert _hits(a_sampler, SECRET) > guesses[SECRET]  # A's own repeat reuses its longer prefix


def test_stop_string_with_a_lone_surrogate_is_a_user_error(tenants, server):
    """Raw HTTP: the SDK cannot encode a lone surrogate, JSON's \\udcff escape can."""
    a, _ = tenants
    sampler = _sampler(a)
    body = {"sampling_session_id": sampler._sampling_session_id, "seq_id": 10_000, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
            "sampling_params": {"max_tokens": 4, "stop": ["\udcff"]}}
    with httpx.Client(base_url=server.base_url + "/api/v1", headers={"X-API-Key": API_KEY}, timeout=60) as http:
        response = http.post("/asample", content=json.dumps(body), headers={"Content-Type": "application/json"})
        if response.status_code == 400:  # refused at the door (the server's JSON check), before any sampler
            result = {"category": "user", "error": response.json()["error"]}
        else:  # accepted: the sample fails as the user's error (the sampler's own check)
            assert response.status_code == 200, response.text
            result = _outcome(http, response.json()["request_id"])
    assert result.get("category") == "user", result
    assert "stop[0]" in result["error"] and "surrogate" in result["error"], result
    out = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=4)).result(timeout=60)
    assert len(out.sequences) == 1  # the sampler keeps serving


def _outcome(http: httpx.Client, request_id: str) -> dict:
    return future_outcome(http, request_id, statuses=(200, 400))


# the service's check is the same for every backend: run against the torch server only
@pytest.mark.slow
@pytest.mark.parametrize("server", ["torch"], indirect=True)
def test_a_value_heads_checkpoint_has_no_sampler(tenants, server):
    a, _ = tenants
    critic = a.create_lora_training_client(base_model=MODEL_NAME, rank=4, user_metadata={"ember.head": "value"}).result()
    path = critic.save_state("critic").result().path
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the old 500 was retried by the SDK forever
        attempt = pool.submit(lambda: _sampler(a, model_path=path).sample(
            types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2)).result())
        with pytest.raises(Exception, match="value head has no sampler") as info:
            attempt.result(timeout=120)
    assert "500" not in str(info.value)


# the service's eviction is the same for every backend: run against the torch server only
@pytest.mark.slow
@pytest.mark.parametrize("server", ["torch"], indirect=True)
def test_a_sampler_evicted_by_the_33rd_is_a_user_error_that_says_so(tenants, server):
    a, _ = tenants
    tc = a.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
    tc.forward_backward([sft_datum([5, 9, 14, 22])], "cross_entropy").result()
    samplers = [tc.save_weights_and_get_sampling_client().result() for _ in range(33)]
    prompt, params = types.ModelInput.from_ints([5, 6]), types.SamplingParams(max_tokens=2)
    assert len(samplers[-1].sample(prompt, 1, params).result(timeout=60).sequences) == 1
    with pytest.raises(tinker.RequestFailedError, match="evicted.*max_samplers_per_session") as info:
        samplers[0].sample(prompt, 1, params).result(timeout=60)
    assert info.value.category == types.RequestErrorCategory.User


def test_a_light_tenants_sample_is_not_held_up_by_a_heavy_backlog(tenants):
    a, b = tenants
    a_sampler, b_sampler = _sampler(a), _sampler(b)
    prompt = types.ModelInput.from_ints([5, 6, 7, 8, 9, 10, 11, 12])
    a_sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4)).result(timeout=120)  # warm
    heavy = [b_sampler.sample(prompt, 256, types.SamplingParams(max_tokens=300, stop=[])) for _ in range(20)]
    time.sleep(2.0)  # B's 20 requests reach the server and queue
    start = time.monotonic()
    out = a_sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, stop=[])).result(timeout=120)
    took = time.monotonic() - start
    answered = sum(f.future().done() for f in heavy)  # a fast host answers a few of B's by now
    assert len(out.sequences[0].tokens) == 4
    print(f"A's 4-token sample behind B's backlog: {took:.3f} s ({answered} of B's 20 answered)")
    assert answered <= 8, f"B's backlog was {20 - answered} requests when A was answered, not >= 12"
    assert took < 2.0, f"A's 4-token sample took {took:.2f} s behind B's backlog"
    # beyond its bound, B's backlog is refused as a user error: of 12 more requests, one is over
    # the bound while at most 10 of B's 20 have been answered
    extra = [b_sampler.sample(prompt, 256, types.SamplingParams(max_tokens=300, stop=[])) for _ in range(12)]
    wait_until(lambda: any(f.future().done() for f in extra), 60, interval=0.1, message="one of 12 more to be answered")
    refused = [f for f in extra if f.future().done() and f.future().exception() is not None]
    assert refused, f"none of 12 more requests refused ({answered} of B's 20 answered before)"
    with pytest.raises(tinker.RequestFailedError, match="max_queued_sample_tokens_per_key") as info:
        refused[0].result()
    assert info.value.category == types.RequestErrorCategory.User
    assert len(a_sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4)).result(timeout=60).sequences) == 1
