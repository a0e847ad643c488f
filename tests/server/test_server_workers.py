"""`ember serve --workers.runtime process --workers.world_size 2`: every training run is one
FSDP2 engine on two local rank processes, driven by the unmodified official SDK.

Same losses as in-process engines (contract 2, fp32 rtol 1e-5), checkpoints and samplers
from the worker-group run agree with its `forward` (contract 5, abs 1e-4), a bad layout
exits non-zero before anything starts, and stopping the server leaves no rank behind.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import psutil
import pytest
import tinker
from tinker import types

import ember
from helpers.server import API_KEY, MODEL_NAME, sft_datum, start_server, wait_until

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

LR = types.AdamParams(learning_rate=2e-2)
PROMPT = [5, 17, 30, 42, 8, 61]


def batch() -> list[types.Datum]:
    return [sft_datum([5, 6, 7, 8, 9, 10], [0.0, 1.0, 1.0, 0.5, 2.0]), sft_datum([11, 12, 13, 14]),
            sft_datum([20, 21, 22, 23, 24, 25, 26, 27])]


def sft(client, steps: int = 3):
    """A LoRA SFT loop; (the training client, loss:sum of each forward_backward)."""
    tc = client.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=11).result()
    losses = []
    for _ in range(steps):
        losses.append(tc.forward_backward(batch(), "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(LR).result()
    return tc, losses


def forward_logprobs(tc, tokens: list[int]) -> np.ndarray:
    """The engine's logprobs of tokens[1:] given the prefix (contract 5's reference)."""
    out = tc.forward([sft_datum(tokens)], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()


@pytest.fixture(scope="module")
def group_server(tiny_model_dir, tmp_path_factory):
    server = start_server(Path(tiny_model_dir), tmp_path_factory.mktemp("ember-serve-workers"),
                          extra_args=["--workers.runtime", "process", "--workers.world_size", "2"])
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def sc(group_server):
    client = tinker.ServiceClient(base_url=group_server.base_url, api_key=API_KEY)
    yield client
    if group_server.alive():  # the last test stops the server
        client.close("success").result(timeout=30)


@pytest.fixture(scope="module")
def trained(sc):
    return sft(sc)


def test_sft_on_two_ranks_matches_in_process_engines(trained, tiny_model_dir, tmp_path):
    local = ember.ServiceClient(models={MODEL_NAME: str(tiny_model_dir)}, data_dir=tmp_path)
    try:
        _, in_process = sft(local)
    finally:
        local.close("success")
    _, on_group = trained
    np.testing.assert_allclose(on_group, in_process, rtol=1e-5, atol=0)
    assert on_group[2] < on_group[0]


def test_save_state_resume_and_samplers_agree_with_forward(sc, trained):
    tc, _ = trained
    path = tc.save_state("ws").result().path
    reference = forward_logprobs(tc, PROMPT + [9, 10, 11])
    resumed = sc.create_training_client_from_state(path).result()  # a second engine on the same group
    np.testing.assert_allclose(forward_logprobs(resumed, PROMPT + [9, 10, 11]), reference, rtol=0, atol=1e-6)

    params = types.SamplingParams(max_tokens=8, seed=3, temperature=1.0, stop=[])
    samplers = {"snapshot": tc.save_weights_and_get_sampling_client().result(),  # gathered from the ranks
                "checkpoint": sc.create_sampling_client(model_path=path).result()}  # the sharded DCP checkpoint
    for how, sampler in samplers.items():
        seq = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params).result().sequences[0]
        assert len(seq.tokens) == 8
        expected = forward_logprobs(tc, PROMPT + list(seq.tokens))[len(PROMPT) - 1:]
        np.testing.assert_allclose(seq.logprobs, expected, rtol=0, atol=1e-4, err_msg=how)


def rank_processes(server) -> list[psutil.Process]:
    return [p for p in psutil.Process(server.proc.pid).children(recursive=True) if "python" in p.name().lower()]


def test_ranks_run_in_their_own_processes_and_stop_with_the_server(group_server, trained):
    ranks = rank_processes(group_server)
    assert len(ranks) >= 2, [p.cmdline() for p in ranks]  # 2 ranks (+ the forkserver)
    group_server.stop()
    assert group_server.proc.returncode in (0, -15), group_server.stderr_tail()
    wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks), 20,
               message="rank processes to exit")


def test_bad_parallel_layout_exits_nonzero_with_a_message(tiny_model_dir, tmp_path, capsys):
    """`ember serve`'s own code (`cli.run` is what its `main` exits with), in process: a
    subprocess would pay the server's imports for the same return value (exit statuses of a
    real `ember serve` process: test_server_model_loading.py, test_server_datadir.py)."""
    from ember.server import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    argv = ["--model", f"{MODEL_NAME}={tiny_model_dir}", "--data-dir", str(tmp_path / "ember-bad-layout"),
            "--port", "0", "--workers.runtime", "process", "--workers.world_size", "2",
            "--parallel.tp", "2", "--parallel.dp_shard", "2"]
    assert cli.run(parser.parse_args(argv)) == 2
    stdout, stderr = capsys.readouterr()
    assert "parallel.tp=2 = 4 ranks, but workers.world_size=2" in stderr
    assert "listening on" not in stdout


@pytest.mark.parametrize("args, words", [
    (["--workers.runtime", "process", "--workers.world_size", "4", "--parallel.tp", "3"], "does not divide"),
    (["--workers.runtime", "local", "--parallel.dp_shard", "1"], "need a worker group"),
    (["--workers.runtime", "inline", "--workers.world_size", "2"], "exactly one rank"),
    (["--workers.runtime", "process", "--workers.ray_address", "auto"], "only used with workers.runtime 'ray'"),
    (["--workers.runtime", "process", "--workers.world_size", "0"], "integer >= 1"),
    (["--workers.runtime", "ray", "--parallel.tp", "0"], "parallel.tp must be an integer >= 1"),
])
def test_bad_worker_options_are_rejected_before_anything_starts(args, words, tmp_path, capsys):
    from ember.server import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(["--data-dir", str(tmp_path), *args])) == 2
    assert words in capsys.readouterr().err


def test_worker_options_build_the_layout():
    from ember.server import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    parse = lambda *a: cli.load_serve_config(parser.parse_args(list(a))).workers  # noqa: E731
    assert parse().runtime == "local" and parse().world_size == 1
    assert parse("--workers.runtime", "process", "--workers.world_size", "4").parallel_dims() == \
        {"dp_replicate": 1, "dp_shard": 4, "tp": 1}  # default: FSDP2 over every rank
    assert parse("--workers.runtime", "ray", "--workers.world_size", "8", "--parallel.tp", "2",
                 "--parallel.dp_replicate", "2").parallel_dims() == {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
    ray = parse("--workers.runtime", "ray", "--workers.ray_address", "ray://head:10001")
    assert ray.ray_address == "ray://head:10001"
    engine = cli.load_serve_config(parser.parse_args(["--data-dir", "/tmp/x", "--engine.micro_batch_tokens",
                                                      "64", "--workers.runtime", "inline"])).service.engine
    assert engine.micro_batch_tokens == 64  # --engine.* still reach every engine
