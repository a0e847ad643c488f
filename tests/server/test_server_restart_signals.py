"""Nothing lost on a restart (README "Restarts"), over HTTP with the official SDK against
real `ember serve` processes on one data directory and port:

* SIGTERM between steps, and SIGTERM while a forward_backward executes: the server exits 0
  with one line; the SDK client's training loop goes on through its own retries (its
  submission retries the refused connection, its future polls retrieve_future until the
  next server answers it), and the run equals an uninterrupted one bit for bit (losses,
  logprobs, and every exported parameter by torch.equal). LoRA and full fine-tuning, SQLite
  and PostgreSQL.
* A sampling session made from a saved checkpoint keeps working across the restarts, and so
  do those made by save_weights_and_get_sampling_client (their in-memory weights are saved,
  older ones included).
* SIGKILL with `--runs.autosave_every_steps 2`: the run comes back from its last automatic
  save and the client's next answer says from which step (`ember_resumed_from_step:max`).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import tinker
import torch
from safetensors.torch import load_file
from tinker import types

from helpers.server import API_KEY, MODEL_NAME, sft_datum, start_server, wait_until
from ember.service.runs import RESUMED_METRIC

from .test_server_external_weights import _full_training_client

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

ADAM = types.AdamParams(learning_rate=2e-2)
GREEDY = types.SamplingParams(max_tokens=4, temperature=0.0)
PROMPT = types.ModelInput.from_ints([3, 1, 4, 1])
BATCHES = [[sft_datum([3, 1, 4, 1, 5, 9, 2, 6])], [sft_datum([2, 7, 1, 8, 2, 8])],
           [sft_datum([1, 4, 1, 4, 2, 1, 3])], [sft_datum([1, 7, 3, 2, 0, 5])]]


def training_client(sc: tinker.ServiceClient, base_url: str, kind: str) -> tinker.TrainingClient:
    if kind == "lora":
        return sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=8).result(timeout=120)
    return _full_training_client(sc, base_url)


def step(tc: tinker.TrainingClient, i: int) -> types.ForwardBackwardOutput:
    fb = tc.forward_backward(BATCHES[i], "cross_entropy")
    tc.optim_step(ADAM).result(timeout=300)
    return fb.result(timeout=300)


def exported(tc: tinker.TrainingClient, data_dir: Path, name: str) -> dict[str, torch.Tensor]:
    """Every trained tensor of the run, as its sampler export holds it."""
    tc.save_weights_for_sampler(name).result(timeout=300)
    found = list((data_dir / "checkpoints").glob(f"*/sampler_weights/{name}.*/**/*.safetensors"))
    found += list((data_dir / "checkpoints").glob(f"*/sampler_weights/{name}.*/*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(set(found)):
        tensors.update(load_file(f))
    assert tensors, f"no export found for {name}"
    return tensors


def assert_same_step(a: types.ForwardBackwardOutput, b: types.ForwardBackwardOutput) -> None:
    assert a.metrics["loss:sum"] == b.metrics["loss:sum"]
    for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs, strict=True):
        assert torch.equal(x["logprobs"].to_torch(), y["logprobs"].to_torch())


def sigterm(server) -> None:
    """SIGTERM, then: exit 0, one line, no traceback."""
    server.stop(timeout=120)
    tail = server.stderr_tail()
    assert server.proc.returncode == 0, tail
    assert "ember serve: stopped (SIGTERM)" in tail and "Traceback" not in tail, tail


def in_background(fn):
    """`fn()` on a thread (the SDK retries meanwhile); join() returns its result."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()), daemon=True)
    t.start()

    def join():
        t.join(600)
        return out["r"]

    return join


def accepted_forward_backwards(server) -> int:
    return sum(1 for e in server.requests() if e.get("status") == 200 and e["path"].endswith("/forward_backward"))


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_sigterm_between_steps_and_mid_step_loses_nothing(kind, tiny_model_dir, tmp_path, database_url):
    data_dir, flags = tmp_path / "data", ["--database-url", database_url, "--runs.save_on_shutdown", "true"]
    start = lambda name, env=None, port=0: start_server(  # noqa: E731
        Path(tiny_model_dir), tmp_path / name, data_dir=data_dir, port=port, extra_args=flags, env=env)
    server = start("run1")
    port, servers = server.port, [server]
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    try:
        reference_tc = training_client(sc, server.base_url, kind)
        reference = [step(reference_tc, i) for i in range(4)]
        want = exported(reference_tc, data_dir, "reference")

        tc = training_client(sc, server.base_url, kind)
        got = [step(tc, 0), step(tc, 1)]
        sampler = sc.create_sampling_client(model_path=tc.save_weights_for_sampler("mid").result(timeout=300).path)
        sampled = sampler.sample(PROMPT, 1, GREEDY).result(timeout=300).sequences[0].tokens
        sigterm(server)  # between steps: the next step's requests meet a closed port, then a new server
        third = in_background(lambda: step(tc, 2))
        # the third op after the restart sleeps 8 s on the lane: SIGTERM arrives while it executes,
        # and outlasts uvicorn's 5 s for open requests: the SDK's poll is cut and retried
        server = start("run2", env={"EMBER_FAILPOINTS": "run.op=sleep:8*1@3"}, port=port)
        servers.append(server)
        got.append(third())
        fourth = tc.forward_backward(BATCHES[3], "cross_entropy")
        wait_until(lambda: accepted_forward_backwards(server) >= 2, timeout=120, message="the 4th step accepted")
        sigterm(server)  # its forward_backward finishes within the drain bound; its answer is kept
        server = start("run3", port=port)
        servers.append(server)
        got.append(fourth.result(timeout=300))  # the SDK polled through the restart
        tc.optim_step(ADAM).result(timeout=300)
        assert sampler.sample(PROMPT, 1, GREEDY).result(timeout=300).sequences[0].tokens == sampled

        for a, b in zip(got, reference, strict=True):
            assert_same_step(a, b)
        have = exported(tc, data_dir, "resumed")
        assert have.keys() == want.keys()
        assert all(torch.equal(have[k], want[k]) for k in want)
    finally:
        sc.close("success").result(timeout=60)
        for s in servers:
            s.stop()


def test_sigkill_comes_back_from_the_last_autosave_and_says_from_which_step(tiny_model_dir, tmp_path):
    data_dir, flags = tmp_path / "data", ["--runs.autosave_every_steps", "2"]
    server = start_server(Path(tiny_model_dir), tmp_path / "run1", data_dir=data_dir, extra_args=flags)
    servers = [server]
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    try:
        reference_tc = training_client(sc, server.base_url, "lora")
        reference = [step(reference_tc, i) for i in range(3)]
        tc = training_client(sc, server.base_url, "lora")
        for i in range(3):
            step(tc, i)  # saved automatically after step 2; step 3 is lost with the process
        server.kill9()
        server = start_server(Path(tiny_model_dir), tmp_path / "run2", data_dir=data_dir, port=server.port,
                              extra_args=flags)
        servers.append(server)
        out = step(tc, 2)  # the client's loop goes on; the server is at step 2 again
        assert out.metrics[RESUMED_METRIC] == 2.0
        assert_same_step(out, reference[2])
    finally:
        sc.close("success").result(timeout=60)
        for s in servers:
            s.stop()


def test_sigterm_keeps_a_snapshot_sampling_client_sampling_the_same_weights(tiny_model_dir, tmp_path):
    """`save_weights_and_get_sampling_client` holds its weights in memory only: a clean stop
    saves them, and the same client object (same sampling session id) samples the same
    greedy tokens from the next server, whether it holds the run's weights at the stop or
    weights from before its last optim_step."""
    data_dir, flags = tmp_path / "data", ["--runs.save_on_shutdown", "true"]
    server = start_server(Path(tiny_model_dir), tmp_path / "run1", data_dir=data_dir, extra_args=flags)
    servers = [server]
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    try:
        tc = training_client(sc, server.base_url, "lora")
        step(tc, 0)
        sampler = tc.save_weights_and_get_sampling_client().result(timeout=300)
        before = sampler.sample(PROMPT, 1, GREEDY).result(timeout=300).sequences[0].tokens
        step(tc, 1)  # the run moves on: `sampler` holds older weights now
        newer = tc.save_weights_and_get_sampling_client().result(timeout=300)
        after = newer.sample(PROMPT, 1, GREEDY).result(timeout=300).sequences[0].tokens
        sigterm(server)
        server = start_server(Path(tiny_model_dir), tmp_path / "run2", data_dir=data_dir, port=server.port,
                              extra_args=flags)
        servers.append(server)
        assert sampler.sample(PROMPT, 1, GREEDY).result(timeout=300).sequences[0].tokens == before
        assert newer.sample(PROMPT, 1, GREEDY).result(timeout=300).sequences[0].tokens == after
    finally:
        sc.close("success").result(timeout=60)
        for s in servers:
            s.stop()
