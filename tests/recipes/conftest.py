"""Fixtures for the recipe tests: a tiny digit-sum model and a real `ember serve` subprocess."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading

import pytest

API_KEY = "tml-test"
SERVED_NAME = "tiny-digits"


@pytest.fixture(scope="session")
def digit_model_dir(tmp_path_factory):
    """A tiny Qwen3 (hidden 64, 2 layers) whose char tokenizer covers the digit-sum task."""
    from ember.models.testing import build_tiny_model
    from ember.recipes.digit_sum import ALPHABET

    return build_tiny_model(tmp_path_factory.mktemp("digit-model"), family="qwen3", seed=0,
                            tokenizer_alphabet=ALPHABET)


def _read_url(proc: subprocess.Popen, timeout: float) -> str:
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"ember serve did not report its URL within {timeout} s") from None
        if "listening on" in line:
            return line.strip().rsplit(" ", 1)[-1]


@pytest.fixture(scope="module")
def ember_server(digit_model_dir, tmp_path_factory):
    """`python -m ember.cli serve` on a free loopback port; yields its base URL."""
    data_dir = tmp_path_factory.mktemp("serve-data")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "ember.cli", "serve", "--model", f"{SERVED_NAME}={digit_model_dir}",
           "--port", "0", "--data-dir", str(data_dir), "--api-key", API_KEY, "--log-level", "warning"]
    stderr_path = data_dir / "stderr.txt"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    try:
        url = _read_url(proc, timeout=120)
        yield url
    except TimeoutError:
        pytest.fail(f"ember serve failed to start: {stderr_path.read_text()[-3000:]}")
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class DigitCountEnv:
    """Reward = fraction of completion tokens that are digits: graded, so groups are never
    all equal and every GRPO step trains (the digit-sum reward is 0 for a random model)."""

    def __new__(cls, tokenizer):
        from ember.recipes.env import Environment, Problem

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
