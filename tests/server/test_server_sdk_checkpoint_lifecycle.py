"""Checkpoint lifecycle over HTTP with the unmodified SDK: publish / unpublish (another API
key samples and loads a published checkpoint, and is refused like for a path never saved
once it is unpublished), TTLs (expired = 404 everywhere, files swept), user_metadata and
overwrite, hostile inputs, and a restart keeping it all (SQLite file).

One server of its own (module scope): a short `--checkpoints.sweep_interval_s`, and a data
directory the restart test reopens."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import tinker
from tinker import types

from helpers.server import API_KEY, MODEL_NAME, OTHER_KEY, sft_datum, start_server, wait_until
from helpers.zygote import run_module

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

PROMPT = types.ModelInput.from_ints([3, 9, 27, 81, 4])
LOGPROBS = types.SamplingParams(max_tokens=1)
SWEEP = ["--checkpoints.sweep_interval_s", "0.3"]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("lifecycle-serve")
    srv = start_server(Path(tiny_model_dir), workdir, extra_args=SWEEP)
    srv.workdir = workdir
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def owner(server):
    client = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    yield client
    client.close("success").result(timeout=30)


@pytest.fixture(scope="module")
def other(server):
    client = tinker.ServiceClient(base_url=server.base_url, api_key=OTHER_KEY)
    yield client
    client.close("success").result(timeout=30)


@pytest.fixture(scope="module")
def rest(server):
    return tinker.RestClient(base_url=server.base_url, api_key=API_KEY)


@pytest.fixture(scope="module")
def other_rest(server):
    return tinker.RestClient(base_url=server.base_url, api_key=OTHER_KEY)


def train_and_save(client):
    """A LoRA run after one step; (training client, state path, sampler path)."""
    tc = client.create_lora_training_client(base_model=MODEL_NAME, rank=3, seed=2).result()
    tc.forward_backward([sft_datum([5, 17, 30, 42, 8, 61])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    state = tc.save_state("pub-state", user_metadata={"step": "1"}).result().path
    sampler = tc.save_weights_for_sampler("pub-sampler").result().path
    return tc, state, sampler


@pytest.fixture(scope="module")
def trained(owner):
    return train_and_save(owner)


@pytest.fixture
def restarted_later(tiny_model_dir, tmp_path_factory):
    """A server of its own for the restart test, so the module's server keeps its live runs
    for the other tests in any order: (server, its RestClient, train_and_save's triple)."""
    workdir = tmp_path_factory.mktemp("lifecycle-restart")
    srv = start_server(Path(tiny_model_dir), workdir, extra_args=SWEEP)
    srv.workdir = workdir
    client = tinker.ServiceClient(base_url=srv.base_url, api_key=API_KEY)
    try:
        yield srv, tinker.RestClient(base_url=srv.base_url, api_key=API_KEY), train_and_save(client)
    finally:
        client.close("success").result(timeout=30)
        srv.stop()


def prompt_logprobs(sampler) -> np.ndarray:
    resp = sampler.sample(PROMPT, 1, LOGPROBS, include_prompt_logprobs=True).result()
    return np.array(resp.prompt_logprobs[1:])


def listed(rest, path):
    return {c.tinker_path: c for c in rest.list_user_checkpoints().result().checkpoints}.get(path)


def test_publish_lets_another_key_sample_and_load_until_unpublished(server, owner, other, rest, other_rest, trained):
    tc, state, sampler = trained
    mine = prompt_logprobs(owner.create_sampling_client(model_path=sampler).result())
    never = sampler.replace("pub-sampler", "never-saved")
    with pytest.raises(tinker.NotFoundError) as foreign:
        other.create_sampling_client(model_path=sampler).result()
    with pytest.raises(tinker.NotFoundError) as missing:
        other.create_sampling_client(model_path=never).result()
    assert str(foreign.value).replace(sampler, "P") == str(missing.value).replace(never, "P")

    for path in (state, sampler):
        rest.publish_checkpoint_from_tinker_path(path).result()
    rest.publish_checkpoint_from_tinker_path(state).result()  # publishing twice is no error
    assert listed(rest, state).public and listed(rest, sampler).public
    theirs = other.create_sampling_client(model_path=sampler).result()
    np.testing.assert_allclose(prompt_logprobs(theirs), mine, rtol=0, atol=1e-6)
    loaded = other.create_training_client_from_state_with_optimizer(state).result()
    assert loaded.get_info().lora_rank == 3
    assert other_rest.get_weights_info_by_tinker_path(state).result().lora_rank == 3
    oai = openai.OpenAI(base_url=server.base_url + "/v1", api_key=OTHER_KEY, max_retries=0)
    assert oai.completions.create(model=sampler, prompt="hi", max_tokens=2).choices
    assert listed(other_rest, state) is None  # read by path, never listed for another key

    for path in (state, sampler):
        rest.unpublish_checkpoint_from_tinker_path(path).result()
    assert not listed(rest, state).public and not listed(rest, sampler).public
    with pytest.raises(tinker.NotFoundError) as again:
        other.create_sampling_client(model_path=sampler).result()
    assert str(again.value).replace(sampler, "P") == str(missing.value).replace(never, "P")
    with pytest.raises(tinker.NotFoundError):
        theirs.sample(PROMPT, 1, LOGPROBS).result()  # the client made while published stops too
    with pytest.raises(tinker.RequestFailedError) as load:
        other.create_training_client_from_state(state).result()
    assert load.value.category == types.RequestErrorCategory.User and "not visible" in str(load.value)
    with pytest.raises(tinker.NotFoundError):
        other_rest.get_weights_info_by_tinker_path(state).result()
    with pytest.raises(openai.NotFoundError) as oai_err:
        oai.completions.create(model=sampler, prompt="hi", max_tokens=2)
    assert oai_err.value.body["code"] == "model_not_found"
    np.testing.assert_allclose(prompt_logprobs(owner.create_sampling_client(model_path=sampler).result()), mine,
                               rtol=0, atol=1e-6)  # the owner reads it as before


def test_only_the_owner_changes_a_checkpoint(rest, other_rest, trained):
    _, state, _ = trained
    rest.publish_checkpoint_from_tinker_path(state).result()
    try:
        for call in (lambda: other_rest.publish_checkpoint_from_tinker_path(state),
                     lambda: other_rest.unpublish_checkpoint_from_tinker_path(state),
                     lambda: other_rest.set_checkpoint_ttl_from_tinker_path(state, 3600),
                     lambda: other_rest.delete_checkpoint_from_tinker_path(state)):
            with pytest.raises(tinker.NotFoundError, match="not owned by this API key"):
                call().result()
        assert listed(rest, state).public and listed(rest, state).expires_at is None
    finally:
        rest.unpublish_checkpoint_from_tinker_path(state).result()


def test_ttl_on_save_and_set_then_expiry_is_404_everywhere_and_swept(server, owner, rest, trained):
    tc, _, _ = trained
    kept = tc.save_weights_for_sampler("ttl-kept", ttl_seconds=3600).result().path
    assert abs((listed(rest, kept).expires_at - listed(rest, kept).time).total_seconds() - 3600) < 1
    rest.set_checkpoint_ttl_from_tinker_path(kept, None).result()
    assert listed(rest, kept).expires_at is None
    short = tc.save_state("ttl-short", ttl_seconds=2).result().path
    sampler = owner.create_sampling_client(model_path=short).result()
    prompt_logprobs(sampler)
    directory = next((server.data_dir / "checkpoints").rglob("ttl-short.*"))
    time.sleep(2.1)
    assert listed(rest, short) is None
    with pytest.raises(tinker.NotFoundError):
        owner.create_sampling_client(model_path=short).result()
    with pytest.raises(tinker.NotFoundError):
        sampler.sample(PROMPT, 1, LOGPROBS).result()
    with pytest.raises(tinker.RequestFailedError, match="not found"):
        owner.create_training_client_from_state(short).result()
    for call in (lambda: rest.delete_checkpoint_from_tinker_path(short),
                 lambda: rest.set_checkpoint_ttl_from_tinker_path(short, 3600),
                 lambda: rest.publish_checkpoint_from_tinker_path(short),
                 lambda: rest.get_weights_info_by_tinker_path(short)):
        with pytest.raises(tinker.NotFoundError):
            call().result()
    wait_until(lambda: not directory.exists(), 10, message="the sweep to delete the expired checkpoint")
    assert listed(rest, kept) is not None


@pytest.mark.parametrize("ttl, message", [
    (-1, "ttl_seconds must be between 1 and 315360000"),
    (0, "ttl_seconds must be between 1 and 315360000"),
    (10**15, "ttl_seconds must be between 1 and 315360000"),
])
def test_hostile_ttl_is_refused_with_the_field_and_range(rest, trained, ttl, message):
    tc, state, _ = trained
    with pytest.raises(tinker.BadRequestError, match=message):
        rest.set_checkpoint_ttl_from_tinker_path(state, ttl).result()
    with pytest.raises(tinker.RequestFailedError, match=message):
        tc.save_state("bad-ttl", ttl_seconds=ttl).result()


def test_hostile_bodies_and_paths_over_raw_http(server, trained):
    _, state, _ = trained
    run_id = state.split("/")[2]
    base = f"{server.base_url}/api/v1/training_runs/{run_id}/checkpoints"
    auth = {"X-API-Key": API_KEY}
    cases = [
        ("PUT", f"{base}/weights/pub-state/ttl", {"ttl": 5}, 400, "ttl_seconds"),
        ("PUT", f"{base}/weights/pub-state/ttl", {"ttl_seconds": "60"}, 400, "ttl_seconds must be an integer"),
        ("PUT", f"{base}/weights/pub-state/ttl", {"ttl_seconds": 60.5}, 400, "ttl_seconds must be an integer"),
        ("PUT", f"{base}/pub-state/ttl", {"ttl_seconds": 60}, 400, "checkpoint_id must look like"),
        ("POST", f"{base}/weights/..%2Fx/publish", None, 400, "checkpoint_id must look like"),
        ("POST", f"{base}/weights/.hidden/publish", None, 400, "invalid checkpoint name"),
        ("POST", f"{base}/external_weights/x/publish", None, 404, "not found"),
        ("POST", f"{base}/weights/a/b/publish", None, 400, "checkpoint_id must look like"),
        ("DELETE", f"{base}/weights/nope/publish", None, 404, "not owned by this API key"),
    ]
    for method, url, body, status, message in cases:
        r = httpx.request(method, url, json=body, headers=auth, timeout=30)
        assert r.status_code == status and message in r.json()["error"], (method, url, r.status_code, r.text)


def test_user_metadata_and_overwrite_are_listed_and_enforced(rest, trained):
    tc, state, _ = trained
    assert listed(rest, state).user_metadata == {"step": "1"}
    with pytest.raises(tinker.RequestFailedError, match="already exists; pass overwrite=True"):
        tc.save_state("pub-state", user_metadata={"step": "2"}).result()
    assert listed(rest, state).user_metadata == {"step": "1"}
    with pytest.raises(tinker.RequestFailedError, match="the limit is 4096"):
        tc.save_state("meta-big", user_metadata={"k": "v" * 5000}).result()
    with pytest.raises(tinker.RequestFailedError, match="the limit is 64"):
        tc.save_weights_for_sampler("meta-many", user_metadata={str(i): "v" for i in range(100)}).result()
    path = tc.save_state("meta-over", user_metadata={"a": "1"}).result().path
    assert tc.save_state("meta-over", overwrite=True, user_metadata={"b": "2"}).result().path == path
    assert listed(rest, path).user_metadata == {"b": "2"}


def test_the_sdk_cli_publishes_sets_ttl_and_unpublishes(server, rest, trained):
    """`tinker checkpoint publish | set-ttl | unpublish`, the SDK's own CLI, against ember serve."""
    _, state, _ = trained
    env = {**os.environ, "TINKER_BASE_URL": server.base_url, "TINKER_API_KEY": API_KEY}

    def cli(*args: str) -> None:
        done = run_module("tinker.cli", ["checkpoint", *args], env=env, timeout=120)  # forked: helpers.zygote
        assert done.returncode == 0, done.stdout + done.stderr

    cli("publish", state)
    cli("set-ttl", state, "--ttl", "7200")
    assert listed(rest, state).public and listed(rest, state).expires_at is not None
    cli("set-ttl", state, "--remove")
    cli("unpublish", state)
    assert not listed(rest, state).public and listed(rest, state).expires_at is None


def test_a_restart_keeps_publish_and_ttl_state(restarted_later, tiny_model_dir):
    server, rest, (tc, state, sampler) = restarted_later
    rest.publish_checkpoint_from_tinker_path(sampler).result()
    rest.set_checkpoint_ttl_from_tinker_path(state, 7200).result()
    before = {p: (listed(rest, p).public, listed(rest, p).expires_at) for p in (state, sampler)}
    server.stop()
    again = start_server(Path(tiny_model_dir), server.workdir, data_dir=server.data_dir, port=server.port,
                         extra_args=SWEEP)
    server.proc = again.proc  # same port: the module's clients carry on, the fixture stops it
    assert {p: (listed(rest, p).public, listed(rest, p).expires_at) for p in (state, sampler)} == before
    assert before[sampler][0] is True and before[state][1] is not None
    other = tinker.RestClient(base_url=again.base_url, api_key=OTHER_KEY)
    assert other.get_weights_info_by_tinker_path(sampler).result().lora_rank == 3
    with pytest.raises(tinker.NotFoundError):
        other.get_weights_info_by_tinker_path(state).result()
