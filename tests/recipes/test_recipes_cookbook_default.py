"""tinker-cookbook 0.6.1's first recipes, `sl_loop` and `rl_loop`, unmodified and with their
default `model_name` ("Qwen/Qwen3.5-9B-Base"), against `ember serve` offline.

A tiny Qwen3.5 (`ember tiny-model --family qwen3_5`) stands in for the 9B. A user serves a
local directory under the hub id the recipe names (`--model Qwen/Qwen3.5-9B-Base=DIR`) and links it into the Hugging Face cache under the same id
(`ember hub-link Qwen/Qwen3.5-9B-Base DIR`), so the recipe's own tokenizer lookup of that
id resolves to DIR with `HF_HUB_OFFLINE=1`; the renderer comes from the cookbook's table
for that id. The hub data sets are local stand-ins in the hub's layout (README.md configs,
`main/train.jsonl` for gsm8k's "main" configuration), read by `datasets.load_dataset` from
the working directory. The recipes run as plain subprocesses (not forked from the
zygote): `HF_HUB_CACHE` must be read by a fresh `huggingface_hub` import.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.server import API_KEY, server_env, start_server

pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is not installed (`make test` installs it)")

pytestmark = pytest.mark.slow

HUB_ID = "Qwen/Qwen3.5-9B-Base"  # both recipes' default model_name
FAMILY = "qwen3_5"  # the family the recipes name: hybrid Gated DeltaNet + attention


def _gsm8k(work: Path) -> None:
    """openai/gsm8k's "main" configuration: a question and a worked answer ending in '#### N'."""
    root = work / "openai" / "gsm8k"
    (root / "main").mkdir(parents=True)
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n"
        "  - split: test\n    path: main/test.jsonl\n---\n")
    for split in ("train", "test"):
        with (root / "main" / f"{split}.jsonl").open("w") as f:
            for a in range(8):
                f.write(json.dumps({"question": f"What is {a} + {a + 1}?", "answer": f"{a}+{a + 1}=#### {2 * a + 1}"}) + "\n")


def _no_robots(work: Path) -> None:
    """HuggingFaceH4/no_robots: chat `messages` (user, assistant) per row."""
    root = work / "HuggingFaceH4" / "no_robots"
    root.mkdir(parents=True)
    for split in ("train", "test"):
        with (root / f"{split}.jsonl").open("w") as f:
            for a in range(8):
                f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {a}?"},
                                                 {"role": "assistant", "content": str(2 * a)}]}) + "\n")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from ember.cli import main

    work = tmp_path_factory.mktemp("cookbook-default")
    assert main(["tiny-model", str(work / "model"), "--family", FAMILY]) == 0
    assert main(["hub-link", HUB_ID, str(work / "model"), "--cache-dir", str(work / "hf-cache")]) == 0
    _gsm8k(work)
    _no_robots(work)
    return work


@pytest.fixture(scope="module")
def server(work):
    server = start_server(work / "model", work / "serve", model_name=HUB_ID)
    yield server
    server.stop(timeout=60)


def run_recipe(work: Path, base_url: str, module: str, args: list[str]) -> list[dict]:
    log_path = work / "runs" / module.rsplit(".", 1)[-1]
    env = {**server_env(), "TINKER_BASE_URL": base_url, "TINKER_API_KEY": API_KEY, "HF_HUB_CACHE": str(work / "hf-cache"),
           # a cache of its own: `datasets` keys a local directory's cache by its name (gsm8k/main),
           # not its path, so another run's stand-in of the same name would be read instead
           "HF_DATASETS_CACHE": str(work / "datasets-cache"), "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", module, f"log_path={log_path}", *args], cwd=work, env=env,
                          capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{module} failed ({proc.returncode}):\n{output[-4000:]}"
    assert "Training completed" in output, output[-4000:]
    assert "Using renderer: role_colon" in output  # the cookbook's table entry for the hub id
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def check_rows(rows: list[dict], key: str, steps: int) -> None:
    with_key = [r for r in rows if key in r]
    assert len(with_key) == steps, f"expected {steps} rows with {key!r}: {rows}"
    assert all(math.isfinite(r[key]) for r in with_key), with_key


def test_sl_loop_runs_with_its_default_model_name(work, server):
    rows = run_recipe(work, server.base_url, "tinker_cookbook.recipes.sl_loop",
                      ["batch_size=4", "max_steps=2", "max_length=256", "save_every=0", "lora_rank=8"])
    check_rows(rows, "train_mean_nll", 2)


def test_rl_loop_runs_with_its_default_model_name(work, server):
    rows = run_recipe(work, server.base_url, "tinker_cookbook.recipes.rl_loop",
                      ["batch_size=2", "group_size=2", "max_steps=2", "max_tokens=8", "save_every=0", "lora_rank=8"])
    assert rows and all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    assert len({r["step"] for r in rows if "step" in r}) == 2, rows
