"""The Bradley-Terry reward model on synthetic preference pairs, and PPO with its scores as reward."""

from __future__ import annotations

import math

import pytest

import ember
from ember.metrics import MetricsConfig, MetricsLogger, use_logger
from ember.recipes.common import ClientConfig
from ember.recipes.ppo import VALUE_HEAD, PPOConfig, run_ppo
from ember.recipes.reward_model import RMConfig, load_pairs, run_reward_model, train_reward_model

from .conftest import API_KEY, SERVED_NAME

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client_config(digit_model_dir, tmp_path_factory):
    return ClientConfig(models={"tiny": str(digit_model_dir)}, data_dir=str(tmp_path_factory.mktemp("ember")))


def test_bt_reward_model_ranks_heldout_pairs(client_config):
    # Seeds 0, 1, 2 (lr 3e-3, 16 pairs a step): held-out accuracy 1.0 from step 5 on (0.984 once).
    cfg = RMConfig(base_model="tiny", lora_rank=8, steps=12, pairs_per_step=16, learning_rate=3e-3,
                   train_pairs=256, eval_pairs=64, eval_every=6, seed=0)
    sc = ember.ServiceClient(models=client_config.models, data_dir=client_config.data_dir)
    try:
        rm = sc.create_lora_training_client(base_model="tiny", rank=8, seed=0, user_metadata=dict(VALUE_HEAD)).result()
        train, heldout = load_pairs(cfg, rm.get_tokenizer())
        logger = MetricsLogger()
        with use_logger(logger):
            acc = train_reward_model(rm, train, heldout, cfg)
    finally:
        sc.close("success")
    history = [m for _, m in logger.history]
    assert acc > 0.8 and history[-1]["rm/heldout_accuracy"] == acc
    assert [i for i, m in enumerate(history) if "rm/heldout_accuracy" in m] == [5, 11]
    assert history[-1]["rm/loss"] < 0.5 * history[0]["rm/loss"]
    assert history[-1]["rm/margin"] > 1.0 > history[0]["rm/margin"]


def test_ppo_with_reward_model(client_config, capsys):
    """`run_reward_model` saves a value-head state; PPO restores it and scores rollouts with it."""
    quiet = {"console": False, "tensorboard": False}
    rm_cfg = RMConfig(base_model="tiny", lora_rank=4, steps=8, pairs_per_step=8, learning_rate=3e-3, train_pairs=64,
                      eval_pairs=16, save_name="rm", client=client_config, metrics=quiet)
    path = run_reward_model(rm_cfg)
    assert path.startswith("tinker://") and path.endswith("/weights/rm")
    cfg = PPOConfig(base_model="tiny", lora_rank=4, critic_lora_rank=4, reward_model=path, steps=2,
                    prompts_per_step=4, samples_per_prompt=2, max_tokens=3, save_name="", client=client_config,
                    metrics=MetricsConfig(console=False, tensorboard=False))
    seen = []
    logger = MetricsLogger()
    with use_logger(logger):
        assert run_ppo(cfg, on_step=lambda step, m: seen.append(m)) is None
    assert len(seen) == 2
    for m in seen:
        assert math.isfinite(m["ppo/reward"]) and m["ppo/reward"] != m["ppo/task_reward"]  # the RM's scores
    import tinker

    with pytest.raises(tinker.RequestFailedError, match="checkpoint .*/weights/rm-missing' not found"):
        run_ppo(PPOConfig(**{**cfg.__dict__, "reward_model": path.replace("/rm", "/rm-missing")}))
    # a policy checkpoint is not a reward model: refused, not read as garbage scores
    policy = run_ppo(PPOConfig(**{**cfg.__dict__, "reward_model": "", "steps": 1, "save_name": "policy"}))
    critic = capsys.readouterr().out.split("ppo: critic saved ", 1)[1].split()[0]
    assert critic.endswith("/weights/policy-critic") and critic.split("/weights/")[0] != policy.split("/weights/")[0]
    with pytest.raises(tinker.RequestFailedError, match="checkpoint holds a 'policy'-head run"):
        run_ppo(PPOConfig(**{**cfg.__dict__, "reward_model": policy}))
    # the critic saved beside the policy resumes as a critic (and a policy state as the critic is refused)
    resumed = PPOConfig(**{**cfg.__dict__, "critic_init_from": critic, "init_from": policy, "steps": 1})
    assert run_ppo(resumed) is None
    with pytest.raises(tinker.RequestFailedError, match="checkpoint holds a 'policy'-head run"):
        run_ppo(PPOConfig(**{**cfg.__dict__, "critic_init_from": policy}))


def test_reward_model_and_ppo_over_http_with_the_sdk(ember_server):
    """The same recipes through the unmodified tinker SDK against `ember serve`: a value-head reward
    model trained by `forward_backward_custom`, then PPO (critic `ppo_value`, KL reference) scored by it."""
    client = ClientConfig(base_url=ember_server, api_key=API_KEY)
    quiet = MetricsConfig(console=False, tensorboard=False)
    rm_steps: list[dict[str, float]] = []
    path = run_reward_model(RMConfig(base_model=SERVED_NAME, lora_rank=4, steps=6, pairs_per_step=8,
                                     learning_rate=3e-3, train_pairs=48, eval_pairs=16, save_name="rm-http",
                                     client=client, metrics=quiet), on_step=lambda s, m: rm_steps.append(m))
    assert path.endswith("/weights/rm-http") and rm_steps[-1]["rm/heldout_accuracy"] > 0.8
    seen: list[dict[str, float]] = []
    cfg = PPOConfig(base_model=SERVED_NAME, lora_rank=4, critic_lora_rank=4, reward_model=path, kl_coef=0.1,
                    steps=1, prompts_per_step=4, samples_per_prompt=2, max_tokens=3, save_name="",
                    client=client, metrics=quiet)
    with use_logger(MetricsLogger()):
        run_ppo(cfg, on_step=lambda s, m: seen.append(m))
    assert len(seen) == 1 and seen[0]["ppo/kl_ref"] == pytest.approx(0.0, abs=1e-4)  # sampled from the reference
    assert all(math.isfinite(m["ppo/reward"]) and m["ppo/value_loss"] >= 0 for m in seen)
    with pytest.raises(ValueError, match="PPOConfig.critic_full_ft: full fine-tuning needs ember's "
                                         "create_full_training_client, which ServiceClient lacks"):
        run_ppo(PPOConfig(**{**cfg.__dict__, "critic_full_ft": True, "reward_model": ""}))
