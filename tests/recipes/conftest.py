"""Fixtures for the recipe tests: a tiny digit-sum model and a real `ember serve` process."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.server import start_server

API_KEY = "tml-test"
SERVED_NAME = "tiny-digits"


@pytest.fixture(scope="session")
def digit_model_dir(tmp_path_factory):
    """A tiny Qwen3 (hidden 64, 2 layers) whose char tokenizer covers the digit-sum task."""
    from ember.models.testing import build_tiny_model
    from ember.recipes.digit_sum import ALPHABET

    return build_tiny_model(tmp_path_factory.mktemp("digit-model"), family="qwen3", seed=0,
                            tokenizer_alphabet=ALPHABET)


@pytest.fixture
def recipe_toml(digit_model_dir, tmp_path):
    """`write(name, fields)`: tmp_path/name holding `fields` (a recipe's own top-level keys, as
    TOML) and the sections every `ember train` test shares: [client] (the digit model as "tiny",
    data under tmp_path/ember) and [metrics] (no console, no tensorboard); returns its path."""
    def write(name: str, fields: str) -> Path:
        path = tmp_path / name
        path.write_text(f"{fields.strip()}\n[client]\nmodels = {{ tiny = \"{digit_model_dir}\" }}\n"
                        f"data_dir = \"{tmp_path / 'ember'}\"\n[metrics]\nconsole = false\ntensorboard = false\n")
        return path

    return write


@pytest.fixture(scope="module")
def ember_server(digit_model_dir, tmp_path_factory):
    """A real `ember serve` (helpers.server) of the digit model; yields its base URL."""
    server = start_server(digit_model_dir, tmp_path_factory.mktemp("serve"), model_name=SERVED_NAME, keys=(API_KEY,))
    try:
        yield server.base_url
    finally:
        server.stop()


class DigitCountEnv:
    """Reward = fraction of completion tokens that are digits: graded, so groups are never
    all equal and every GRPO step trains (the digit-sum reward is 0 for a random model)."""

    def __new__(cls, tokenizer):
        from ember.recipes.rl.env import Environment, Problem

        digits = {tokenizer.convert_tokens_to_ids(c) for c in "0123456789"}

        class _Env(Environment):
            def sample_problems(self, n, rng):
                out = []
                for _ in range(n):
                    x = rng.randint(100, 999)
                    text = f"Sum the digits of {x}:"
                    out.append(Problem(tuple(tokenizer.encode(text, add_special_tokens=False)), text, x))
                return out

            def reward(self, problem, completion_tokens):
                toks = list(completion_tokens)
                return sum(t in digits for t in toks) / max(1, len(toks))

        return _Env()


@pytest.fixture(scope="session")
def digit_count_env():
    return DigitCountEnv
