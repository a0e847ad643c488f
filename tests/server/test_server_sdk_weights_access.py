"""Over HTTP with the official SDK: `weights_access_token` lets another key load a private
checkpoint its owner made a token for (and is refused, saying why, otherwise), and
`retrieve_future`'s `allow_metadata_only` is answered with the result's size first when the
result is over `--inline-result-mb`."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from helpers.server import API_KEY, MODEL_NAME, OTHER_KEY, sft_datum, start_server

pytestmark = pytest.mark.slow

PROBE = [5, 9, 14, 22, 31, 40, 7]
INLINE_BYTES = 64  # --inline-result-mb below: a probe's forward output is larger


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    proc = start_server(Path(tiny_model_dir), tmp_path_factory.mktemp("weights-access"),
                        extra_args=["--inline-result-mb", str(INLINE_BYTES / 2**20)])
    yield proc
    proc.stop()


def logprobs(tc: tinker.TrainingClient) -> list[float]:
    out = tc.forward([sft_datum(PROBE)], "cross_entropy").result(timeout=120)
    return out.loss_fn_outputs[0]["logprobs"].tolist()


@pytest.fixture(scope="module")
def shared(server):
    """alice's (API_KEY) trained run saved as a private checkpoint, and a token for it."""
    alice = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    tc = alice.create_lora_training_client(base_model=MODEL_NAME, rank=4).result(timeout=120)
    tc.forward_backward([sft_datum(PROBE)], "cross_entropy").result(timeout=120)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
    path = tc.save_state("shared").result(timeout=120).path
    run_id, checkpoint_id = path.removeprefix("tinker://").split("/", 1)
    resp = httpx.post(f"{server.base_url}/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}/access_token",
                      json={"ttl_seconds": 3600}, headers={"X-API-Key": API_KEY})
    assert resp.status_code == 200, resp.text
    yield path, resp.json()["weights_access_token"], logprobs(tc)
    alice.close("success").result(timeout=30)


@pytest.fixture(scope="module")
def bob(server):
    client = tinker.ServiceClient(base_url=server.base_url, api_key=OTHER_KEY)
    yield client
    client.close("success").result(timeout=30)


def test_a_token_lets_another_key_load_the_checkpoint(bob, shared):
    path, token, alice_lp = shared
    tc = bob.create_training_client_from_state(path, weights_access_token=token).result(timeout=120)
    assert logprobs(tc) == pytest.approx(alice_lp, rel=1e-5, abs=0)


def test_without_the_token_or_with_another_the_load_fails_saying_why(bob, shared):
    path, token, _ = shared
    with pytest.raises(tinker.RequestFailedError, match="not visible to this API key"):
        bob.create_training_client_from_state(path).result(timeout=120)
    with pytest.raises(tinker.RequestFailedError, match="weights_access_token does not grant access"):
        bob.create_training_client_from_state(path, weights_access_token=token[:-3] + "abc").result(timeout=120)


def test_only_the_owner_makes_a_token(server, shared):
    path, _, _ = shared
    run_id, checkpoint_id = path.removeprefix("tinker://").split("/", 1)
    resp = httpx.post(f"{server.base_url}/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}/access_token",
                      json={}, headers={"X-API-Key": OTHER_KEY})
    assert resp.status_code == 404 and "not owned by this API key" in resp.json()["error"]


def test_a_large_result_is_announced_by_its_size_first(server, bob, shared):
    path, token, alice_lp = shared
    mark = server.log_mark()
    tc = bob.create_training_client_from_state(path, weights_access_token=token).result(timeout=120)
    assert logprobs(tc) == pytest.approx(alice_lp, rel=1e-5, abs=0)  # the SDK then polled for the bytes
    polls = server.requests_since(mark, "/api/v1/retrieve_future")
    announced = [p for p in polls if p["extra"].get("metadata_only")]
    assert announced, "no result was announced by its size"
    for poll in announced:
        assert poll["json"]["allow_metadata_only"] is True
        assert poll["response"]["status"] == "complete_metadata"
        assert poll["response"]["response_payload_size"] > INLINE_BYTES
        request_id = poll["json"]["request_id"]
        # its next poll did not allow metadata only, and got the bytes
        later = [p for p in polls if p["json"].get("request_id") == request_id and p["n"] > poll["n"]]
        assert later and later[0]["json"]["allow_metadata_only"] is False
        assert not later[0]["extra"].get("metadata_only")
