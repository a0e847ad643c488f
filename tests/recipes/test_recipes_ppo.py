"""PPO with a critic on the digit-sum task, in process on a tiny model, and `ember train ppo`."""

from __future__ import annotations

import json
import math

import pytest

import ember
from ember.metrics import MetricsConfig, MetricsLogger, read_jsonl, use_logger
from ember.recipes.digit_sum import make_env as make_digit_sum_env
from ember.recipes.ppo import PPOConfig, create_critic, train_ppo

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def service_client(digit_model_dir, tmp_path_factory):
    sc = ember.ServiceClient(models={"tiny": str(digit_model_dir)}, data_dir=tmp_path_factory.mktemp("ember"))
    yield sc
    sc.close("success")


def run(sc, **overrides) -> list[dict[str, float]]:
    cfg = PPOConfig(**{**dict(base_model="tiny", lora_rank=8, critic_lora_rank=8, prompts_per_step=16,
                                samples_per_prompt=4, max_tokens=4, learning_rate=3e-3, critic_learning_rate=3e-3,
                                epochs=2, minibatches=2, seed=0), **overrides})
    policy = sc.create_lora_training_client(base_model="tiny", rank=cfg.lora_rank, seed=cfg.seed).result()
    critic = create_critic(sc, cfg)
    env = make_digit_sum_env(policy.get_tokenizer(), partial_credit=True)
    logger = MetricsLogger()
    with use_logger(logger):
        train_ppo(policy, critic, env, cfg)
    return [m for _, m in logger.history]


def test_ppo_reward_rises_and_critic_learns(service_client):
    # Seeds 0, 1, 2 (20 steps): reward of the first 3 steps 0.008-0.016, of the last 3 0.26-0.30
    # (the policy learns to answer with an integer: partial credit 0.3); the critic's explained
    # variance starts at -109..-165 (random value head) and peaks at 0.156 / 0.033 / 0.096.
    history = run(service_client, steps=20)
    reward = [m["ppo/reward"] for m in history]
    ev = [m["ppo/explained_variance"] for m in history if "ppo/explained_variance" in m]
    first, last = sum(reward[:3]) / 3, sum(reward[-3:]) / 3
    assert last > first + 0.1, reward
    assert ev[0] < 0 < max(ev), ev
    assert all(m["ppo/value_loss"] >= 0 and "ppo/policy_loss" in m and m["ppo/time/roles"] > 0 for m in history)


def test_ppo_overlap_changes_timing_only(service_client):
    """Submitting role forwards and updates together (full-FT critic: its own lane; KL to the
    reference sampler) gives the same numbers as awaiting each request at once."""
    runs = [run(service_client, steps=2, critic_full_ft=True, kl_coef=0.1, overlap=overlap, seed=3)
            for overlap in (True, False)]
    for key in ("ppo/reward", "ppo/kl_ref", "ppo/value_loss", "ppo/policy_loss", "ppo/adv_std"):
        got, want = [m[key] for m in runs[0]], [m[key] for m in runs[1]]
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), key
    assert runs[0][0]["ppo/kl_ref"] == pytest.approx(0.0, abs=1e-4)  # step 0 samples from the reference itself
    assert runs[0][1]["ppo/kl_ref"] != pytest.approx(0.0, abs=1e-4)


def test_ember_train_ppo_cli(recipe_toml, tmp_path, capsys):
    from ember.cli import main

    config = recipe_toml("ppo.toml", f"""
base_model = "tiny"
lora_rank = 4
critic_lora_rank = 4
steps = 3
prompts_per_step = 2
samples_per_prompt = 2
max_tokens = 3
env_args = {{ partial_credit = true }}
run_dir = "{tmp_path / 'run'}"
""")
    assert main(["train", "ppo", "--config", str(config), "--steps", "1", "--save_name", "done"]) == 0
    out = capsys.readouterr().out
    assert "saved tinker://" in out and "/weights/done" in out
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0] and {"ppo/reward", "ppo/value_loss", "ppo/time/sample"} <= set(rows[0])
    assert json.loads((tmp_path / "run" / "config.json").read_text())["env_args"] == {"partial_credit": True}
    assert main(["train", "ppo", "--config", str(config), "--env", "nope"]) == 1
    assert "PPOConfig.env: unknown environment 'nope'" in capsys.readouterr().err


def test_ppo_kl_reference_outlives_sampler_eviction(digit_model_dir, tmp_path):
    """The step-0 reference is saved weights: with at most 2 snapshots per session it is evicted
    and reloaded from disk, and PPO goes on measuring the KL to it."""
    from ember.service.config import ServiceConfig

    sc = ember.ServiceClient(config=ServiceConfig(data_dir=tmp_path / "data", models={"tiny": str(digit_model_dir)},
                                                  max_samplers_per_session=2))
    try:
        history = run(sc, steps=4, prompts_per_step=2, samples_per_prompt=2, minibatches=1, kl_coef=0.5,
                      learning_rate=1e-2)
    finally:
        sc.close("success")
    kl = [m["ppo/kl_ref"] for m in history]
    assert len(kl) == 4 and abs(kl[0]) < 1e-4 and all(math.isfinite(k) for k in kl) and kl[-1] != kl[0]


def test_ppo_critic_on_another_service(digit_model_dir, tmp_path, capsys):
    """`critic_client` puts the critic on another ember (here a second in-process service with
    its own data directory, standing in for a second `ember serve` on other devices)."""
    from ember.recipes.common import ClientConfig
    from ember.recipes.ppo import run_ppo

    policy_dir, critic_dir = tmp_path / "policy", tmp_path / "critic"
    cfg = PPOConfig(base_model="tiny", critic_base_model="tiny-critic", lora_rank=4, critic_lora_rank=4, steps=2,
                    prompts_per_step=2, samples_per_prompt=2, max_tokens=3, seed=0, save_name="done",
                    env_args={"partial_credit": True}, metrics=MetricsConfig(console=False, tensorboard=False),
                    client=ClientConfig(models={"tiny": str(digit_model_dir)}, data_dir=str(policy_dir)),
                    critic_client=ClientConfig(models={"tiny-critic": str(digit_model_dir)}, data_dir=str(critic_dir)))
    history = []
    assert run_ppo(cfg, on_step=lambda step, m: history.append(m)).endswith("/weights/done")
    assert len(history) == 2 and all("ppo/explained_variance" in m or "ppo/value_loss" in m for m in history)
    critic_path = capsys.readouterr().out.split("ppo: critic saved ")[1].split()[0]
    with ember.ServiceClient(models={"tiny-critic": str(digit_model_dir)}, data_dir=critic_dir) as sc:
        restored = sc.create_training_client_from_state(critic_path, user_metadata={"ember.head": "value"}).result()
        assert restored.get_info().model_data.model_name == "tiny-critic"
    with ember.ServiceClient(models={"tiny": str(digit_model_dir)}, data_dir=policy_dir) as sc, \
            pytest.raises(Exception, match="not found|unknown|no checkpoint"):
        sc.create_training_client_from_state(critic_path).result()  # not the policy's service
