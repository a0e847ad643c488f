"""The unmodified official SDK against `ember serve --sampler.backend vllm`: sampling,
save_weights_and_get_sampling_client, compute_logprobs, and two LoRA tenants whose
samplers never see each other's adapters (contract 5 over HTTP, fp32 CPU, abs 1e-4)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from helpers.server import API_KEY, MODEL_NAME, OTHER_KEY, sft_datum, start_server, wait_until

pytestmark = [pytest.mark.slow,
              pytest.mark.needs_vllm]

VLLM_ARGS = ["--sampler.backend", "vllm", "--sampler.max_len", "256", "--limits.max_lora_rank", "8",
             "--sampler.max_slots", "16"]
PROMPT = [5, 17, 30, 42, 8, 61]


@pytest.fixture(scope="module")
def vllm_server(tiny_vllm_model_dir, tmp_path_factory):
    server = start_server(Path(tiny_vllm_model_dir), tmp_path_factory.mktemp("ember-serve-vllm"), extra_args=VLLM_ARGS)
    yield server
    server.stop(timeout=60)
    assert server.proc.returncode in (0, -15), server.stderr_tail()


def _tenant(server, key: str, seed: int, tokens: list[int]):
    """A tenant's LoRA run after two optimizer steps on its own data, and its sampler."""
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=seed).result()
    for _ in range(2):
        tc.forward_backward([sft_datum(tokens)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return sc, tc, tc.save_weights_and_get_sampling_client().result()


def _forward_logprobs(tc, tokens: list[int]) -> np.ndarray:
    out = tc.forward([sft_datum(tokens)], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()


def test_two_lora_tenants_sample_their_own_weights(vllm_server):
    a_sc, a_tc, a_sampler = _tenant(vllm_server, API_KEY, 1, [5, 17, 30, 42, 8, 61, 9, 9, 9])
    b_sc, b_tc, b_sampler = _tenant(vllm_server, OTHER_KEY, 2, [5, 17, 30, 42, 8, 61, 70, 71, 72])
    prompt = types.ModelInput.from_ints(PROMPT)
    params = types.SamplingParams(max_tokens=8, seed=3, temperature=1.0, stop=[])
    for tc, sampler in ((a_tc, a_sampler), (b_tc, b_sampler)):
        seqs = sampler.sample(prompt, 3, params).result().sequences
        assert [len(s.tokens) for s in seqs] == [8, 8, 8]
        for s in seqs:  # the sampled logprobs are this tenant's trainer's (contract 5)
            got = _forward_logprobs(tc, PROMPT + s.tokens)[len(PROMPT) - 1:]
            assert np.abs(got - np.asarray(s.logprobs)).max() < 1e-4
        scored = sampler.compute_logprobs(prompt).result()
        assert scored[0] is None
        assert np.abs(np.asarray(scored[1:]) - _forward_logprobs(tc, PROMPT)).max() < 1e-4
    # the two adapters differ, and each sampler reports its own
    a_scored = np.asarray(a_sampler.compute_logprobs(prompt).result()[1:])
    b_scored = np.asarray(b_sampler.compute_logprobs(prompt).result()[1:])
    assert np.abs(a_scored - b_scored).max() > 1e-3
    # seeded samples are reproducible through the server
    again = a_sampler.sample(prompt, 3, params).result().sequences
    first = a_sampler.sample(prompt, 3, params).result().sequences
    assert [s.tokens for s in again] == [s.tokens for s in first]
    for client in (a_sc, b_sc):
        client.close("success").result(timeout=30)


def test_base_model_sampling_and_stop_strings(vllm_server):
    sc = tinker.ServiceClient(base_url=vllm_server.base_url, api_key=API_KEY)
    sampler = sc.create_sampling_client(base_model=MODEL_NAME)
    tok = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result().get_tokenizer()
    out = sampler.sample(types.ModelInput.from_ints(PROMPT), 2,
                         types.SamplingParams(max_tokens=20, temperature=0.0, stop=[])).result()
    greedy = out.sequences[0].tokens
    assert out.sequences[1].tokens == greedy and len(greedy) == 20
    text = tok.decode(greedy, skip_special_tokens=True)
    stop = text[4:6]
    cut = sampler.sample(types.ModelInput.from_ints(PROMPT), 1,
                         types.SamplingParams(max_tokens=20, temperature=0.0, stop=[stop])).result().sequences[0]
    assert cut.stop_reason == "stop" and stop in tok.decode(cut.tokens, skip_special_tokens=True)
    assert cut.tokens == greedy[: len(cut.tokens)]
    sc.close("success").result(timeout=30)


def _engine_pids(server) -> list[int]:
    import psutil

    children = psutil.Process(server.proc.pid).children(recursive=True)
    return [p.pid for p in children if p.name().startswith("VLLM")]


def test_engine_killed_mid_request_fails_with_server_category_and_is_rebuilt(vllm_server):
    import os
    import signal
    import time

    sc = tinker.ServiceClient(base_url=vllm_server.base_url, api_key=API_KEY)
    sampler = sc.create_sampling_client(base_model=MODEL_NAME)
    prompt = types.ModelInput.from_ints(PROMPT)
    assert sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result().sequences
    pids = _engine_pids(vllm_server)
    assert pids, "no vLLM engine process under the server"
    # Freeze the engine first so the request cannot finish before the kill (a fast machine
    # finished it inside a fixed delay), then kill it once the server has accepted the request
    # and handed it to the frozen engine.
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    def accepted() -> int:
        return len([e for e in vllm_server.requests("/asample") if e["status"] == 200])

    before = accepted()
    pending = sampler.sample(prompt, 8, types.SamplingParams(max_tokens=240, stop=[], seed=1))
    wait_until(lambda: accepted() > before, 60, interval=0.05, message="the server to accept the sample request")
    time.sleep(1.0)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(tinker.RequestFailedError) as failed:
        pending.result()
    assert failed.value.category == types.RequestErrorCategory.Server
    # the server keeps serving: training needs no sampler, and the next sample starts a new engine
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
    tc.forward_backward([sft_datum(PROMPT)], "cross_entropy").result()
    again = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=3, stop=[], seed=2)).result()
    assert [len(s.tokens) for s in again.sequences] == [3, 3]
    assert set(_engine_pids(vllm_server)).isdisjoint(pids)
    sc.close("success").result(timeout=30)
