"""tinker-cookbook 0.6.1's recipes, unmodified (`python -m tinker_cookbook.recipes.X` with
their own CLI arguments), against a real `ember serve` on an `ember tiny-model` model.
Each recipe is a process of its own, forked from the pytest worker's zygote
(`helpers.zygote.run_module`: `runpy` runs the module as `-m` does; torch, transformers and
the SDK are already imported).

Each runs 1-2 steps: the test asserts that the recipe ran to completion against ember and
wrote its metrics, with finite values, not that it learned. The recipes load the
tokenizer themselves from `model_name` (here the model's directory, which also names the
registered model: see ModelRegistry) and run with the Hugging Face hub switched off
(`HF_HUB_OFFLINE`, `HF_DATASETS_OFFLINE`): nothing is downloaded.

Hub data sets are replaced by local stand-ins the recipe loads unmodified: the recipes
call `datasets.load_dataset("Anthropic/hh-rlhf")` (DPO) and
`load_dataset("zwhe99/DeepMath-103K", split="train")` (on-policy distillation), and
`load_dataset` reads a local directory of that name, relative to the working directory,
before it would ask the hub. The stand-ins hold a few arithmetic rows in the original
fields (`chosen`/`rejected` as "\\n\\nHuman: ...\\n\\nAssistant: ...", `question`).
chat_sl trains on the cookbook's own `example_data/conversations.jsonl`; math_rl
(arithmetic) and guess_number generate their problems.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest

from helpers.server import API_KEY, server_env, start_server
from helpers.zygote import run_module

pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is not installed (`make test` installs it)")

pytestmark = pytest.mark.slow

RL = ["eval_every=0", "save_every=0", "max_tokens=4"]
RECIPES = {  # id: (module, arguments after model_name/log_path; the metric every step row must carry)
    "chat_sl": ("tinker_cookbook.recipes.chat_sl.train",
                ["renderer_name=role_colon", "dataset={conversations}", "batch_size=4", "max_steps=2",
                 "max_length=1024", "eval_every=0", "save_every=0"], "train_mean_nll"),
    "math_rl-stable_reinforce": ("tinker_cookbook.recipes.math_rl.train",
                                 ["renderer_name=role_colon", "env=arithmetic", "groups_per_batch=2", "group_size=2",
                                  "max_steps=2", "loss_fn=stable_reinforce", *RL], "optim/entropy"),
    "math_rl-async": ("tinker_cookbook.recipes.math_rl.train",
                      ["renderer_name=role_colon", "env=arithmetic", "groups_per_batch=2", "group_size=2",
                       "max_steps=2", "max_steps_off_policy=1", *RL], "sampling_client/step_min"),
    "dpo": ("tinker_cookbook.recipes.preference.dpo.train",
            ["renderer_name=role_colon", "dataset=hhh", "batch_size=4", "max_steps=2", "max_length=512"], "dpo_loss"),
    "on_policy_distillation": ("tinker_cookbook.recipes.distillation.on_policy_distillation",
                               ["teacher_model={model}", "renderer_name=role_colon", "dataset=deepmath",
                                "groups_per_batch=2", "group_size=2", "lora_rank=8", "max_steps=2",
                                "eval_every=0", "save_every=0", "max_tokens=8"], "teacher_kl"),
    "guess_number": ("tinker_cookbook.recipes.multiplayer_rl.guess_number.train",
                     ["renderer_name=qwen3_instruct", "group_size=2", "batch_size=2", "max_tokens=8", "max_steps=1",
                      "eval_every=0", "save_every=0"], "env/all/turns_per_episode"),
}


def _stand_ins(work: Path) -> None:
    """Local copies, in the original fields, of the hub data sets two recipes load."""
    rng = random.Random(0)
    hh = work / "Anthropic" / "hh-rlhf"
    hh.mkdir(parents=True)
    for split, n in (("train", 32), ("test", 8)):
        with (hh / f"{split}.jsonl").open("w") as f:
            for _ in range(n):
                a, b = rng.randint(1, 50), rng.randint(1, 50)
                q = f"\n\nHuman: What is {a} + {b}?\n\nAssistant:"
                f.write(json.dumps({"chosen": f"{q} {a + b}", "rejected": f"{q} {a + b + 1}"}) + "\n")
    deepmath = work / "zwhe99" / "DeepMath-103K"
    deepmath.mkdir(parents=True)
    with (deepmath / "train.jsonl").open("w") as f:
        for i in range(16):
            f.write(json.dumps({"question": f"What is {i} + {i + 1}?"}) + "\n")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The directory the recipes run in: `ember tiny-model`'s model and the stand-ins."""
    from ember.cli import main

    work = tmp_path_factory.mktemp("cookbook")
    assert main(["tiny-model", str(work / "tiny-model")]) == 0
    _stand_ins(work)
    return work


@pytest.fixture(scope="module")
def torch_server(work):
    server = start_server(work / "tiny-model", work / "serve-torch", model_name="tiny")
    yield server
    server.stop(timeout=60)


def run_recipe(work: Path, base_url: str, name: str, module: str, args: list[str]) -> list[dict]:
    """Run one recipe as a user would (its module, its CLI); return its metrics rows."""
    import tinker_cookbook

    model = str(work / "tiny-model")
    conversations = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    log_path = work / "runs" / name
    argv = [sys.executable, "-m", module, f"model_name={model}", f"log_path={log_path}",
            "behavior_if_log_dir_exists=delete",
            *(a.format(model=model, conversations=conversations) for a in args)]
    env = {**server_env(), "TINKER_BASE_URL": base_url, "TINKER_API_KEY": API_KEY, "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = run_module(argv[2], argv[3:], cwd=work, env=env, timeout=600)  # helpers.zygote: imports spared
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name} failed ({proc.returncode}):\n{output[-4000:]}"
    assert "completed successfully" in output, output[-4000:]
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def check_metrics(name: str, rows: list[dict], key: str) -> None:
    steps = [r for r in rows if key in r]
    assert steps, f"{name}: no metrics row carries {key!r}: {rows}"
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"{name}: non-finite metrics at step {row.get('step')}: {bad}"


@pytest.mark.parametrize("name", list(RECIPES))
def test_cookbook_recipe_runs_unmodified_against_ember_serve(work, torch_server, name):
    module, args, key = RECIPES[name]
    rows = run_recipe(work, torch_server.base_url, name, module, args)
    check_metrics(name, rows, key)
    if name == "math_rl-async":
        check_async_versions(rows)


def check_async_versions(rows: list[dict]) -> None:
    """The cookbook's async loop (AsyncConfig) ran: every training step reports the versions of the
    weights its groups were sampled from, none newer than the weights being trained."""
    steps = [r for r in rows if "training_client/step" in r]
    assert [r["training_client/step"] for r in steps] == [0, 1], rows
    for r in steps:
        assert 0 <= r["sampling_client/step_min"] <= r["sampling_client/step_max"] <= r["training_client/step"], r


@pytest.mark.needs_vllm
def test_math_rl_with_the_vllm_sampler(work):
    server = start_server(work / "tiny-model", work / "serve-vllm", model_name="tiny", timeout=600,
                          extra_args=["--sampler.backend", "vllm", "--sampler.max_len", "1024"])
    try:
        module, args, key = RECIPES["math_rl-stable_reinforce"]
        check_metrics("math_rl-vllm", run_recipe(work, server.base_url, "math_rl-vllm", module, args), key)
    finally:
        server.stop(timeout=60)
        assert server.proc.returncode in (0, -15), server.stderr_tail()
