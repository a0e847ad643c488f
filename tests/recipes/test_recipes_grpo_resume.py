"""GRPO checkpoints and `resume_from`: a run killed after some steps and resumed gives, step for
step, the metrics of an uninterrupted run with the same seed.

What is compared: every metric but the timings. Those that depend only on the sampled tokens
(reward, reward_max, frac_groups_constant, completion_tokens, staleness, lr) must be equal; the
float ones (loss, sampler_nll, kl_ref, kl_ref_k3) within rel 1e-4 / abs 1e-5. They are not
bit-equal because the sampler's continuous batching puts rows in a decode batch by arrival
time, and the floating-point sums of a batch depend slightly on its rows: two uninterrupted runs
with the same seed differ by as much. Measured on these configs (lr 2e-3, 6 steps): uninterrupted
vs uninterrupted and resumed vs uninterrupted both <= 1.5e-7 on every float metric. Training
amplifies any such difference: at lr 1e-2 both pairs drift apart alike (|d loss| ~1e-4 by step
5, then a token flips), so the test keeps lr 2e-3. The weights and optimizer state themselves
come back bit-exact (`create_training_client_from_state_with_optimizer`).
"""

from __future__ import annotations

import json
import random

import pytest

import ember.recipes.grpo as grpo
from ember.metrics import MetricsLogger, read_jsonl, use_logger
from ember.recipes.common import ClientConfig
from ember.recipes.grpo import GRPOConfig, load_checkpoint, run_grpo, train_grpo
from ember.recipes.resume import CHECKPOINT_FILE, Checkpoint, SavedBatch, write_checkpoint
from ember.recipes.rl.environments import ENVIRONMENTS

from .conftest import API_KEY, SERVED_NAME, DigitCountEnv

TOKEN_METRICS = ("reward", "reward_max", "frac_groups_constant", "completion_tokens", "staleness", "lr")


class Killed(Exception):
    """Raised from on_step: the run dies after that step, its service client closed mid-flight."""


@pytest.fixture(autouse=True)
def digit_count_registered(monkeypatch):
    """The graded digit-count reward as a registered environment, so that run_grpo and `ember train` use it."""
    monkeypatch.setitem(ENVIRONMENTS, "digit_count", lambda tokenizer: DigitCountEnv(tokenizer))


def config(digit_model_dir, data_dir, run_dir, **overrides) -> GRPOConfig:
    settings = dict(base_model="tiny", lora_rank=4, steps=6, prompts_per_step=4, group_size=4, max_tokens=4,
                    learning_rate=2e-3, minibatches=2, seed=0, env="digit_count", save_every=2, save_name="",
                    run_dir=str(run_dir), client=ClientConfig(models={"tiny": str(digit_model_dir)},
                                                              data_dir=str(data_dir)))
    return GRPOConfig(**{**settings, **overrides})


def run(cfg: GRPOConfig, kill_after: int | None = None) -> dict[int, dict[str, float]]:
    """run_grpo in process (its own ServiceClient, as a new process would have); metrics per step."""
    logger = MetricsLogger()

    def on_step(step, summary):
        if step == kill_after:
            raise Killed

    with use_logger(logger):
        try:
            run_grpo(cfg, on_step)
        except Killed:
            pass
    return {step: {k: v for k, v in m.items() if "/time/" not in k} for step, m in logger.history}


def assert_same_steps(resumed: dict, uninterrupted: dict) -> None:
    for step, metrics in resumed.items():
        want = uninterrupted[step]
        assert sorted(metrics) == sorted(want), step
        for key, value in metrics.items():
            if key.split("/", 1)[1] in TOKEN_METRICS:
                assert value == want[key], (step, key)
            else:
                assert value == pytest.approx(want[key], rel=1e-4, abs=1e-5), (step, key)


@pytest.mark.parametrize("overrides", [
    # Both slow (three GRPO runs each): `make test-fast` runs the resume through
    # test_ember_train_grpo_resume_from and the checkpoint/refusal tests below.
    pytest.param(dict(kl_coef=0.5), id="on-policy-kl", marks=pytest.mark.slow),
    pytest.param(dict(kl_coef=0.5, max_staleness=1, loss_fn="ppo"), id="async-kl-ppo", marks=pytest.mark.slow),
])
def test_killed_and_resumed_equals_uninterrupted(digit_model_dir, tmp_path, overrides):
    data_dir = tmp_path / "ember"  # one service's data, as one machine's disk
    uninterrupted = run(config(digit_model_dir, data_dir, tmp_path / "full", **overrides))
    killed_cfg = config(digit_model_dir, data_dir, tmp_path / "killed", **overrides)
    killed = run(killed_cfg, kill_after=2)  # 3 steps done; the last checkpoint is after 2
    saved = json.loads((tmp_path / "killed" / CHECKPOINT_FILE).read_text())
    assert saved["step"] == 2 and saved["state_path"].endswith("/weights/grpo-step-000002")
    assert (saved["batch"] is not None) == (killed_cfg.max_staleness > 0)  # sampled ahead: its samples are kept
    resumed = run(config(digit_model_dir, data_dir, tmp_path / "killed", resume_from=str(tmp_path / "killed"),
                         **overrides))

    assert sorted(uninterrupted) == list(range(6)) and sorted(killed) == [0, 1, 2]
    assert sorted(resumed) == [2, 3, 4, 5]  # step 2 ran before the kill, after the checkpoint: it runs again
    assert_same_steps(killed, uninterrupted)
    assert_same_steps(resumed, uninterrupted)
    assert all(m["grpo/loss"] != 0 for m in uninterrupted.values())  # every step trained
    # the KL reference is the original run's step-0 weights, not the weights it resumed with
    assert uninterrupted[2]["grpo/kl_ref"] > 1e-3
    assert json.loads((tmp_path / "killed" / CHECKPOINT_FILE).read_text())["reference_path"] == saved["reference_path"]
    assert "/sampler_weights/grpo-kl-reference-" in saved["reference_path"]
    want_staleness = [0.0] + [float(killed_cfg.max_staleness > 0)] * 5
    assert [uninterrupted[s]["grpo/staleness"] for s in range(6)] == want_staleness


@pytest.mark.slow  # an `ember serve` start and three runs over HTTP: most of the file's time
def test_killed_and_resumed_over_http(ember_server, tmp_path):
    """The same through the official SDK against `ember serve`: what a checkpoint holds is all the
    SDK offers (save_state, create_training_client_from_state_with_optimizer, sampler paths)."""
    overrides = dict(base_model=SERVED_NAME, steps=4, kl_coef=0.5, max_staleness=1,
                     client=ClientConfig(base_url=ember_server, api_key=API_KEY))
    uninterrupted = run(config("", "", tmp_path / "full", **overrides))
    killed = run(config("", "", tmp_path / "killed", **overrides), kill_after=2)
    resumed = run(config("", "", tmp_path / "killed", resume_from=str(tmp_path / "killed"), **overrides))
    assert sorted(killed) == [0, 1, 2] and sorted(resumed) == [2, 3]
    assert_same_steps(killed, uninterrupted)
    assert_same_steps(resumed, uninterrupted)
    assert uninterrupted[2]["grpo/kl_ref"] > 1e-3 and uninterrupted[2]["grpo/staleness"] == 1.0


def test_ember_train_grpo_resume_from(recipe_toml, tmp_path, capsys):
    """`ember train grpo --resume_from RUN_DIR`: the step after the last checkpoint again, as it ran first."""
    from ember.cli import main

    toml = recipe_toml("grpo.toml", """
base_model = "tiny"
env = "digit_count"
lora_rank = 4
steps = 3
prompts_per_step = 2
group_size = 4
max_tokens = 4
learning_rate = 0.002
save_every = 2
save_name = ""
""")
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(["train", "grpo", "--config", str(toml), "--run_dir", str(first)]) == 0
    assert main(["train", "grpo", "--config", str(toml), "--run_dir", str(second), "--resume_from", str(first)]) == 0
    rows = {r["step"]: r for r in read_jsonl(first / "metrics.jsonl")}
    again = read_jsonl(second / "metrics.jsonl")
    assert [r["step"] for r in again] == [2]
    for key in ("grpo/reward", "grpo/completion_tokens", "grpo/staleness"):
        assert again[0][key] == rows[2][key]
    assert again[0]["grpo/loss"] == pytest.approx(rows[2]["grpo/loss"], rel=1e-4, abs=1e-5)
    assert not (second / CHECKPOINT_FILE).exists()  # it ran step 2 only: 3 steps done is no multiple of 2

    capsys.readouterr()
    assert main(["train", "grpo", "--config", str(toml), "--resume_from", str(tmp_path / "nope")]) == 1
    assert "GRPOConfig.resume_from: no such directory" in capsys.readouterr().err


def written(tmp_path, cfg: GRPOConfig, **fields) -> GRPOConfig:
    """A checkpoint of `cfg`'s run in tmp_path/run (edited by `fields`); returns cfg resuming from it."""
    values = dict(recipe="grpo", step=2, state_path="tinker://run-1/weights/grpo-step-000002",
                  rng_state=random.Random(0).getstate(), config=grpo.run_identity(cfg))
    write_checkpoint(tmp_path / "run", Checkpoint(**{**values, **fields}))
    return GRPOConfig(**{**cfg.__dict__, "resume_from": str(tmp_path / "run")})


def test_bad_resume_inputs_are_refused(tmp_path):
    cfg = GRPOConfig(steps=4, seed=0, run_dir=str(tmp_path / "new"))
    with pytest.raises(ValueError, match=r"GRPOConfig.resume_from: no such directory '.*missing'"):
        load_checkpoint(GRPOConfig(resume_from=str(tmp_path / "missing")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"GRPOConfig.resume_from: '.*empty' holds no checkpoint.json"):
        load_checkpoint(GRPOConfig(resume_from=str(tmp_path / "empty")))
    resume = written(tmp_path, cfg)
    assert load_checkpoint(resume).step == 2  # the well-formed one is accepted
    assert load_checkpoint(GRPOConfig(**{**resume.__dict__, "steps": 2, "eval_every": 1})).step == 2
    with pytest.raises(ValueError, match=r"is of another run: seed = 0 there, 1 here"):
        load_checkpoint(GRPOConfig(**{**resume.__dict__, "seed": 1}))
    with pytest.raises(ValueError, match=r"another run: group_size = 8 there, 4 here; lora_rank = 32 there, 8 here"):
        load_checkpoint(GRPOConfig(**{**resume.__dict__, "group_size": 4, "lora_rank": 8}))
    with pytest.raises(ValueError, match=r"the checkpoint is at step 2, beyond steps = 1 \(expected steps >= 2\)"):
        load_checkpoint(GRPOConfig(**{**resume.__dict__, "steps": 1}))
    written(tmp_path, cfg, step=9)
    with pytest.raises(ValueError, match=r"at step 9, beyond steps = 4"):
        load_checkpoint(resume)
    written(tmp_path, cfg, recipe="ppo")
    with pytest.raises(ValueError, match=r"a checkpoint of recipe 'ppo', expected 'grpo'"):
        load_checkpoint(resume)
    written(tmp_path, cfg, rng_state=(3, (1, 2), None))
    with pytest.raises(ValueError, match=r"'rng_state': not a random.Random state"):
        load_checkpoint(resume)
    written(tmp_path, cfg, state_path="/etc/passwd")
    with pytest.raises(ValueError, match=r"'state_path' must be a tinker:// path, got '/etc/passwd'"):
        load_checkpoint(resume)
    written(tmp_path, cfg, reference_path="../other-tenant/weights")
    with pytest.raises(ValueError, match=r"'reference_path' must be '' or a tinker:// path, got '../other-tenant"):
        load_checkpoint(resume)
    written(tmp_path, cfg, batch=SavedBatch(1, random.Random(0).getstate(), [[("x", [0.5])]]))
    with pytest.raises(ValueError, match=r"'batch': 'samples' must be, per problem, a list of \[tokens, logprobs\]"):
        load_checkpoint(resume)
    (tmp_path / "run" / CHECKPOINT_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=r"checkpoint.json is not readable JSON"):
        load_checkpoint(resume)
    (tmp_path / "run" / CHECKPOINT_FILE).write_text(json.dumps({"format": 7}))
    with pytest.raises(ValueError, match=r"not a checkpoint of format 1 \(got format 7\)"):
        load_checkpoint(resume)


def test_bad_resume_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"GRPOConfig.save_every must be >= 0 \(0: no checkpoints\), got -1"):
        GRPOConfig(save_every=-1)
    # refused before the training client is touched (None here)
    with pytest.raises(ValueError, match=r"GRPOConfig.save_every is 2 but run_dir is empty"):
        train_grpo(None, None, GRPOConfig(save_every=2))
    with pytest.raises(ValueError, match=r"GRPOConfig.resume_from is set but train_grpo got no checkpoint"):
        train_grpo(None, None, GRPOConfig(resume_from=str(tmp_path)))
    # a KL run whose reference was given by its caller records none: the resume must give it again
    cfg = GRPOConfig(kl_coef=0.5, run_dir=str(tmp_path))
    checkpoint = Checkpoint("grpo", 2, "tinker://run-1/weights/x", random.Random(0).getstate(), grpo.run_identity(cfg))
    with pytest.raises(ValueError, match=r"was given its KL reference by its caller \(none is recorded\)"):
        grpo.kl_reference_for(None, cfg, None, checkpoint)


def test_checkpoint_batch_round_trip(digit_model_dir, tmp_path):
    """The in-flight batch comes back with the same problems, tokens and (float) logprobs."""
    from transformers import AutoTokenizer

    env = DigitCountEnv(AutoTokenizer.from_pretrained(digit_model_dir))
    rng = random.Random(3)
    state = rng.getstate()
    problems = env.sample_problems(2, rng)
    samples = [[([1, 2], [-0.1234567890123, -2.5])], [([3], [-1e-9]), ([], [])]]
    cfg = GRPOConfig(prompts_per_step=2, run_dir=str(tmp_path))
    write_checkpoint(tmp_path, Checkpoint("grpo", 1, "tinker://r/weights/a", rng.getstate(), grpo.run_identity(cfg),
                                          batch=SavedBatch(0, state, samples)))
    checkpoint = load_checkpoint(GRPOConfig(**{**cfg.__dict__, "resume_from": str(tmp_path)}))
    start, resumed_rng, batch = grpo.start_point(cfg, env, checkpoint)
    assert start == 1 and resumed_rng.getstate() == rng.getstate() and batch.version == 0
    assert batch.problems == problems
    got = [[(list(s.tokens), list(s.logprobs)) for s in f.result().sequences] for f in batch.futures]
    assert got == samples  # exact: JSON keeps every bit of a float
    with pytest.raises(ValueError, match=r"batch has samples of 2 problems, the environment drew 3"):
        grpo.restore_batch(checkpoint.batch, env, 3)

