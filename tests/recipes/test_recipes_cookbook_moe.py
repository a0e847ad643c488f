"""tinker-cookbook 0.6.1's math_rl, unmodified, against `ember serve` on tiny mixture-of-experts
models: `ember tiny-model --family qwen3_moe` with the cookbook's `qwen3` renderer, and
`--family gpt_oss` with its gpt-oss renderer (`gpt_oss_no_sysprompt`: harmony markers, which
the tiny gpt-oss tokenizer has as single tokens). The recipe runs as in
tests/recipes/test_recipes_cookbook.py (its module and CLI, forked from the zygote, hub off;
`env=arithmetic` generates its problems, so no data set is read), two steps of LoRA RL with
the torch sampler (vLLM refuses MoE on CPU: tests/sampling/test_sampling_moe.py). The test
asserts that it ran both steps to completion with finite metrics and sampled tokens, not that
it learned. Measured on a loaded 2-core host (another benchmark running): 139 s (qwen3_moe)
and 30 s (gpt_oss)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from helpers.server import API_KEY, server_env, start_server
from helpers.zygote import run_module

pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is not installed (`make test` installs it)")

pytestmark = pytest.mark.slow

RENDERERS = {"qwen3_moe": "qwen3", "gpt_oss": "gpt_oss_no_sysprompt"}  # family: the cookbook's renderer
ARGS = ["env=arithmetic", "groups_per_batch=2", "group_size=2", "max_steps=2", "max_tokens=4", "eval_every=0",
        "save_every=0", "lora_rank=8"]


def run_math_rl(work: Path, base_url: str, renderer: str) -> tuple[list[dict], str]:
    """math_rl as a user runs it (its module, its CLI); its metrics rows and its output."""
    model, log_path = work / "model", work / "run"
    argv = [f"model_name={model}", f"log_path={log_path}", "behavior_if_log_dir_exists=delete",
            f"renderer_name={renderer}", *ARGS]
    env = {**server_env(), "TINKER_BASE_URL": base_url, "TINKER_API_KEY": API_KEY, "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = run_module("tinker_cookbook.recipes.math_rl.train", argv, cwd=work, env=env, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"math_rl ({renderer}) failed ({proc.returncode}):\n{output[-4000:]}"
    assert "completed successfully" in output, output[-4000:]
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()], output


@pytest.mark.parametrize("family", list(RENDERERS))
def test_math_rl_runs_unmodified_on_a_tiny_moe_model(tmp_path, family):
    from ember.cli import main

    assert main(["tiny-model", str(tmp_path / "model"), "--family", family]) == 0
    server = start_server(tmp_path / "model", tmp_path / "serve", model_name=str(tmp_path / "model"))
    try:
        rows, _ = run_math_rl(tmp_path, server.base_url, RENDERERS[family])
    finally:
        server.stop(timeout=60)
    steps = [r for r in rows if "optim/entropy" in r]
    assert len(steps) == 2, rows
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"{family}: non-finite metrics at step {row.get('step')}: {bad}"
    assert all(r["env/all/ac_tokens_per_turn"] > 0 for r in steps), steps  # the server sampled
