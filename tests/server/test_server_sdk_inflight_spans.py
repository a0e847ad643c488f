"""In-flight weights over HTTP with the official SDK: a sequence that is still decoding when
its run makes a new `kind="inflight"` save finishes on the new weights, and the server reports
it as spanning the swap (`GET /api/v1/sessions/{session_id}/sequences/{sequence_id}`, ember's
own provenance read); a sample made after the save sees the new weights."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from helpers.server import API_KEY, MODEL_NAME, OTHER_KEY, sft_datum, start_server, wait_until

pytestmark = pytest.mark.slow  # an `ember serve` of its own

# The held sequence carries a stop string that never matches, and the server's fail point sleeps
# 50 ms at each decode step of such a sequence: 400 greedy tokens hold it for >= 20 s on any host,
# while the training step and the in-flight save take a few seconds. Had the host been slower
# than that, the test fails saying so (below), it does not pass without a swap.
HELD_TOKENS = 400
NEVER = ["\u00a7never-stop\u00a7"]
SLOW_STEPS = {"EMBER_FAILPOINTS": "sampler.stop_strings=sleep:0.05"}
PROMPT = types.ModelInput.from_ints([5, 17, 30, 8])


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    proc = start_server(Path(tiny_model_dir), tmp_path_factory.mktemp("inflight-spans"), env=SLOW_STEPS)
    yield proc
    proc.stop()


def active(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", headers={"X-API-Key": API_KEY}, timeout=30).text
    name = f'ember_sampler_active_sequences{{model="{MODEL_NAME}"}}'
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)), 0.0)


def provenance(base_url: str, session_id: str, sequence_id: str, key: str = API_KEY) -> httpx.Response:
    return httpx.get(f"{base_url}/api/v1/sessions/{session_id}/sequences/{sequence_id}",
                     headers={"X-API-Key": key}, timeout=30)


def greedy(max_tokens: int, stop=()) -> types.SamplingParams:
    return types.SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=1, stop=list(stop))


def test_a_sequence_decoding_through_an_inflight_save_is_reported_as_spanning_it(server):
    base = server.base_url
    sc = tinker.ServiceClient(base_url=base, api_key=API_KEY)
    try:
        tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=9).result()
        follower = tc.save_weights_and_get_sampling_client(kind="inflight", record_stability_info=True).result()
        old = tc.save_weights_and_get_sampling_client().result()  # a snapshot: stays on these weights
        short = greedy(8)
        old_tokens = old.sample(PROMPT, 1, short).result().sequences[0].tokens

        held = follower.sample(PROMPT, 1, greedy(HELD_TOKENS, NEVER))
        wait_until(lambda: active(base) == 1, 120, message="the held sequence decoding")
        for _ in range(3):
            tc.forward_backward([sft_datum(PROMPT.to_ints() + [3, 3, 3])], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        new = tc.save_weights_and_get_sampling_client(kind="inflight").result()
        assert active(base) == 1, (f"the held sequence ended before the in-flight save (this host took over "
                                   f"{HELD_TOKENS} x 50 ms for a training step and a save): nothing to test")

        # Within one request: the followed client samples the new weights, like a snapshot of them.
        new_snapshot = tc.save_weights_and_get_sampling_client().result()
        followed = np.array(follower.compute_logprobs(PROMPT).result()[1:])
        assert np.abs(followed - np.array(old.compute_logprobs(PROMPT).result()[1:])).max() > 1e-3
        np.testing.assert_allclose(followed, np.array(new_snapshot.compute_logprobs(PROMPT).result()[1:]),
                                   rtol=0, atol=1e-4)
        assert follower.sample(PROMPT, 1, short).result().sequences[0].tokens == \
            new.sample(PROMPT, 1, short).result().sequences[0].tokens

        seq = held.result().sequences[0]
        assert len(seq.tokens) == HELD_TOKENS
        session_id = sc.holder.get_session_id()
        r = provenance(base, session_id, seq.sequence_id)
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["sequence_id"], body["num_tokens"], body["spans_a_swap"]) == (seq.sequence_id, HELD_TOKENS, True)
        (first, g1), (swap, g2) = [(s["first_token"], s["generation"]) for s in body["version_spans"]]
        assert first == 0 and 0 < swap < HELD_TOKENS and g2 == g1 + 1, body
        # The tokens before the swap are the old weights' greedy continuation.
        assert seq.tokens[:min(swap, 8)] == old_tokens[:min(swap, 8)]

        r = provenance(base, session_id, seq.sequence_id, key=OTHER_KEY)  # another owner: as if absent
        assert r.status_code == 404 and seq.sequence_id in r.text
        assert provenance(base, session_id, "no-such-sequence").status_code == 404
        assert provenance(base, session_id, "x" * 300).status_code == 400
    finally:
        sc.close("success").result(timeout=60)
