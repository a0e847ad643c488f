"""GRPO on the digit-sum task through the official SDK against `ember serve --sampler.backend
vllm`: the demo's fast variant (SFT warm-up, then GRPO sampling with vLLM), reward rising."""

from __future__ import annotations

import io
import statistics
from pathlib import Path

import pytest
import tinker
from rich.console import Console

from ember.recipes.demo import DemoSettings
from helpers.server import API_KEY, start_server

pytestmark = [pytest.mark.slow,
              pytest.mark.needs_vllm]

# The fast demo of test_recipes_demo.py (its calibration: +0.03..+0.10 reward over 60 steps
# with TorchSampler); vLLM draws other samples from the same distributions, and with them
# this seed's reward stays flat for 60 steps (15-step means 0.078 0.072 0.079 0.099: +0.021,
# reproduced exactly run to run) and rises after (0.273 0.149 over steps 60-90: +0.071).
# 90 steps, so the claim does not rest on where one seed's rise starts.
FAST = dict(seed=0, min_digits=1, max_digits=2, labels=40, heldout=19, sft_steps=80, sft_batch=32,
            grpo_steps=90, prompts_per_step=8, grpo_lr=5e-4, grpo_schedule="constant", eval_every=30,
            max_tokens=5, control_steps=5)


def test_grpo_reward_rises_with_vllm_sampling_over_the_sdk(tmp_path):
    from ember.metrics import MetricsLogger, use_logger
    from ember.recipes.demo_run import build_demo_model, run_phases
    from ember.recipes.progress import PhaseProgress

    settings = DemoSettings(**FAST)
    model_dir = build_demo_model(settings, tmp_path / "model")
    server = start_server(Path(model_dir), tmp_path / "serve", model_name="digits",
                          extra_args=["--sampler.backend", "vllm", "--sampler.max_len", "64"])
    try:
        sc = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
        logger = MetricsLogger()
        with use_logger(logger), PhaseProgress(Console(file=io.StringIO()), live=False) as progress:
            run_phases(sc, "digits", settings, progress, control=False)
        sc.close("success").result(timeout=30)
    finally:
        server.stop(timeout=60)
    rewards = [m["grpo/reward"] for _, m in logger.history if "grpo/reward" in m]
    assert len(rewards) == FAST["grpo_steps"]
    first, last = statistics.mean(rewards[:15]), statistics.mean(rewards[-15:])
    assert last > first + 0.03, (first, last, rewards)
