"""`ember serve --workers.runtime process --workers.world_size 2 --parallel.cp 2`: every
training run is one context-parallel engine (Ulysses attention, each sequence split over the
two ranks), driven by the unmodified official SDK, with the same loss and logprobs as an
in-process world-1 engine (fp32 rtol 1e-5). Bad `--parallel.cp` values are refused before
anything starts, naming the key (no server needed for those).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

import ember
from ember.service.config import WorkersConfig
from helpers.server import API_KEY, MODEL_NAME, sft_datum, start_server

# 61 tokens: an odd length, so the two ranks' shards differ in size.
TOKENS = [(7 * i + 3) % 50 + 2 for i in range(61)]
LR = types.AdamParams(learning_rate=2e-2)


def parse_workers(*args: str) -> WorkersConfig:
    from ember.server import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.load_serve_config(parser.parse_args(list(args))).workers


def test_parallel_cp_reaches_the_layout():
    workers = parse_workers("--workers.runtime", "process", "--workers.world_size", "4", "--parallel.cp", "2")
    assert workers.parallel_dims() == {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "cp": 2}
    from ember.engine.parallel import ParallelismConfig

    assert ParallelismConfig(**workers.parallel_dims()).as_dict() == \
        {"world_size": 4, "dp_replicate": 1, "dp_shard": 2, "tp": 1, "cp": 2}
    both = parse_workers("--workers.runtime", "process", "--workers.world_size", "4", "--parallel.cp", "2",
                         "--parallel.tp", "2")
    assert both.parallel_dims() == {"dp_replicate": 1, "dp_shard": 1, "tp": 2, "cp": 2}


@pytest.mark.parametrize("args, words", [
    (["--workers.world_size", "2", "--parallel.cp", "4"], "does not divide workers.world_size=2"),
    (["--workers.world_size", "4", "--parallel.cp", "2", "--parallel.dp_shard", "1"],
     "parallel.cp=2 x parallel.tp=1 = 2 ranks, but workers.world_size=4"),
    (["--workers.world_size", "2", "--parallel.cp", "0"], "parallel.cp must be an integer >= 1"),
])
def test_bad_cp_layout_exits_2_naming_the_key(args, words, tmp_path, capsys):
    from ember.server import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    argv = ["--data-dir", str(tmp_path), "--workers.runtime", "process", *args]
    assert cli.run(parser.parse_args(argv)) == 2
    assert words in capsys.readouterr().err


def test_cp_not_dividing_the_heads_is_refused_before_the_ranks_start(tiny_model_dir, tmp_path, capsys):
    """The tiny Qwen3 has 4 attention heads: cp=3 cannot give each rank whole heads."""
    from ember.server import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    argv = ["--data-dir", str(tmp_path), "--model", f"{MODEL_NAME}={tiny_model_dir}",
            "--workers.runtime", "process", "--workers.world_size", "3", "--parallel.cp", "3"]
    assert cli.run(parser.parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert f"model '{MODEL_NAME}': parallel.cp=3 must divide config.num_attention_heads=4" in err
    with pytest.raises(ValueError, match="parallel.cp=3 must divide config.num_attention_heads=4"):
        ember.ServiceClient(models={MODEL_NAME: str(tiny_model_dir)}, data_dir=tmp_path / "client",
                            workers={"runtime": "process", "world_size": 3, "cp": 3})


def step_and_forward(client) -> tuple[float, np.ndarray]:
    """One LoRA SFT step on the datum, then its logprobs: (loss:sum, logprobs)."""
    tc = client.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=11).result()
    loss = tc.forward_backward([sft_datum(TOKENS)], "cross_entropy").result().metrics["loss:sum"]
    tc.optim_step(LR).result()
    out = tc.forward([sft_datum(TOKENS)], "cross_entropy").result()
    return loss, out.loss_fn_outputs[0]["logprobs"].to_numpy()


@pytest.mark.slow
def test_cp2_server_matches_an_in_process_world1_engine(tiny_model_dir, tmp_path):
    server = start_server(Path(tiny_model_dir), tmp_path / "serve",
                          extra_args=["--workers.runtime", "process", "--workers.world_size", "2",
                                      "--parallel.cp", "2"])
    try:
        sc = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
        on_cp = step_and_forward(sc)
        sc.close("success").result(timeout=30)
    finally:
        server.stop()
    local = ember.ServiceClient(models={MODEL_NAME: str(tiny_model_dir)}, data_dir=tmp_path / "local")
    try:
        in_process = step_and_forward(local)
    finally:
        local.close("success")
    np.testing.assert_allclose(on_cp[0], in_process[0], rtol=1e-5, atol=0)
    assert on_cp[1].shape == (len(TOKENS) - 1,)
    np.testing.assert_allclose(on_cp[1], in_process[1], rtol=1e-5, atol=0)
    # the step lowered the loss: the match covers the update from the cp ranks' summed gradients
    assert -on_cp[1].sum() < on_cp[0]
