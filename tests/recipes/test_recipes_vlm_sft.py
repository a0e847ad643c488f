"""`ember train vlm_sft` (ember/recipes/vlm_sft.py): pictures of coloured shapes made in
code -> the colour's name, on a tiny Qwen3-VL; held-out accuracy goes from chance (0.25)
to clearly above it, in process and against `ember serve` with the official SDK."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.metrics import MetricsLogger, use_logger
from ember.models.testing import build_tiny_model
from ember.recipes.common import ClientConfig
from ember.recipes.vlm_sft import COLOURS, VLMSFTConfig, make_examples, run_vlm_sft
from helpers.server import API_KEY, start_server

pytestmark = pytest.mark.slow
CHANCE = 1 / len(COLOURS)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("vlm-sft-model"), family="qwen3_vl")


def _run(cfg: VLMSFTConfig) -> dict[str, float]:
    logger = MetricsLogger()
    with use_logger(logger):
        run_vlm_sft(cfg)
    seen: dict[str, float] = {}
    for _, metrics in logger.history:
        seen.update({k: v for k, v in metrics.items() if "accuracy" in k})
    return seen


def test_the_examples_are_made_in_code_and_reproducible():
    a, b = make_examples(8, 56, seed=3), make_examples(8, 56, seed=3)
    assert a == b and {e.colour for e in make_examples(64, 56, seed=0)} == set(COLOURS)
    assert all(e.png.startswith(b"\x89PNG") for e in a)


def test_accuracy_rises_from_chance_in_process(vl_dir, tmp_path):
    acc = _run(VLMSFTConfig(base_model=str(vl_dir), save_name="", client=ClientConfig(
        models={str(vl_dir): str(vl_dir)}, data_dir=str(tmp_path / "data"))))
    assert acc["vlm_sft/accuracy_start"] <= 0.5 and acc["vlm_sft/accuracy"] >= 2 * CHANCE, acc


def test_accuracy_rises_from_chance_against_ember_serve(vl_dir, tmp_path):
    server = start_server(vl_dir, tmp_path / "serve", model_name=str(vl_dir))
    try:
        acc = _run(VLMSFTConfig(base_model=str(vl_dir), save_name="vlm",
                                client=ClientConfig(base_url=server.base_url, api_key=API_KEY)))
    finally:
        server.stop()
    assert acc["vlm_sft/accuracy_start"] <= 0.5 and acc["vlm_sft/accuracy"] >= 2 * CHANCE, acc
