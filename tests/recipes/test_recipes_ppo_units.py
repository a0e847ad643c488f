"""Pure pieces of the PPO and reward-model recipes: GAE, per-token rewards, explained
variance, whitening, critic / scoring datum alignment, config refusals, partial credit."""

from __future__ import annotations

import json
import math
import random

import pytest
from tinker import types

from ember.models import load_tokenizer
from ember.recipes.digit_sum import PARTIAL_CREDIT, DigitSumEnv, DigitSumTask, make_env
from ember.recipes.ppo import PPOConfig, completion_values, explained_variance, score_datum, value_datum
from ember.recipes.rl.advantages import gae, token_rewards, whiten


def brute_force_gae(r, v, gamma, lam):
    """A_t = sum_{l>=0} (gamma*lam)^l delta_{t+l}, delta_t = r_t + gamma*V_{t+1} - V_t, V_T = 0."""
    T = len(r)
    vv = list(v) + [0.0]
    delta = [r[t] + gamma * vv[t + 1] - vv[t] for t in range(T)]
    return [sum((gamma * lam) ** l * delta[t + l] for l in range(T - t)) for t in range(T)]


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (1.0, 0.0), (0.0, 1.0), (0.5, 0.5), (0.9, 1.0)])
def test_gae_equals_the_double_sum(gamma, lam):
    rng = random.Random(7)
    for T in (1, 2, 5, 13):
        r = [rng.uniform(-2, 2) for _ in range(T)]
        v = [rng.uniform(-2, 2) for _ in range(T)]
        adv, ret = gae(r, v, gamma, lam)
        assert adv == pytest.approx(brute_force_gae(r, v, gamma, lam), abs=1e-9, rel=0)
        assert ret == pytest.approx([a + x for a, x in zip(adv, v)], abs=1e-12, rel=0)


def test_gae_special_cases():
    r, v = [0.0, 0.0, 1.0], [0.2, 0.5, 0.7]
    adv, ret = gae(r, v, 1.0, 1.0)
    assert ret == pytest.approx([1.0, 1.0, 1.0], abs=1e-12)  # Monte-Carlo return: the final reward
    adv, ret = gae(r, v, 1.0, 0.0)
    assert adv == pytest.approx([0.5 - 0.2, 0.7 - 0.5, 1.0 - 0.7], abs=1e-12)  # one-step TD errors
    with pytest.raises(ValueError, match="2 rewards for 3 values"):
        gae([0.0, 1.0], v, 1.0, 1.0)


def test_token_rewards():
    assert token_rewards(0.7, [-1.0, -2.0, -3.0], None, 0.5) == [0.0, 0.0, 0.7]
    assert token_rewards(1.0, [-1.0, -2.0], [-1.5, -1.0], 0.0) == [0.0, 1.0]  # no KL without a coefficient
    assert token_rewards(1.0, [-1.0, -2.0], [-1.5, -1.0], 0.5) == pytest.approx([-0.25, 1.0 + 0.5], abs=1e-12)
    with pytest.raises(ValueError, match="2 sampler logprobs vs 1 reference"):
        token_rewards(1.0, [-1.0, -2.0], [-1.5], 0.5)


def test_explained_variance():
    y = [1.0, 2.0, 3.0, 4.0]
    assert explained_variance(y, y) == pytest.approx(1.0, abs=1e-12)
    assert explained_variance([2.5] * 4, y) == pytest.approx(0.0, abs=1e-12)  # the mean explains nothing
    assert explained_variance([y[0] + 1, y[1] + 1, y[2] + 1, y[3] + 1], y) == pytest.approx(1.0)  # offset ignored
    assert explained_variance([4.0, 3.0, 2.0, 1.0], y) == pytest.approx(1 - 5.0 / 1.25, abs=1e-12)
    assert math.isnan(explained_variance([0.0, 1.0], [3.0, 3.0]))


def test_whiten():
    w = whiten([1.0, 2.0, 3.0, 6.0])
    assert sum(w) == pytest.approx(0.0, abs=1e-9)
    assert sum(x * x for x in w) / 4 == pytest.approx(1.0, abs=1e-6)


def test_value_datum_alignment_matches_rl_datum():
    d = value_datum([1, 2, 3], [7, 8], returns_T=[0.5, 1.0], old_values_T=[0.1, 0.2], weight=0.25)
    assert d.model_input.to_ints() == [1, 2, 3, 7]
    assert d.loss_fn_inputs["target_tokens"].data == [2, 3, 7, 8]
    assert d.loss_fn_inputs["weights"].data == [0.0, 0.0, 0.25, 0.25]
    assert d.loss_fn_inputs["returns"].data == [0.0, 0.0, 0.5, 1.0]
    assert d.loss_fn_inputs["old_values"].data == pytest.approx([0.0, 0.0, 0.1, 0.2])
    fwd = value_datum([1, 2, 3], [7, 8])
    assert set(fwd.loss_fn_inputs) == {"target_tokens", "weights"}  # a cross_entropy forward datum
    # V_t is read at position len(prompt)-1+t: the state before completion token t
    out = {"logprobs": types.TensorData(data=[9.0, 9.0, 0.3, 0.4], dtype="float32", shape=[4])}
    assert completion_values(out, prompt_len=3) == pytest.approx([0.3, 0.4])
    with pytest.raises(ValueError, match="1 returns for 2 completion tokens"):
        value_datum([1], [7, 8], returns_T=[1.0])
    with pytest.raises(ValueError, match="need a prompt and a completion, got 1 and 0"):
        value_datum([1], [])


def test_score_datum_reads_the_whole_sequence():
    d = score_datum([4, 5, 6])
    assert d.model_input.to_ints() == [4, 5, 6]  # the last position has seen every token
    assert d.loss_fn_inputs["target_tokens"].data == [0, 0, 0]
    assert d.loss_fn_inputs["weights"].data == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="at least one token"):
        score_datum([])


@pytest.mark.parametrize("kwargs,match", [
    ({"epochs": 0}, "PPOConfig.epochs must be >= 1, got 0"),
    ({"lam": 1.5}, r"PPOConfig.lam must be in \[0, 1\], got 1.5"),
    ({"gamma": -0.1}, r"PPOConfig.gamma must be in \[0, 1\], got -0.1"),
    ({"kl_coef": -1.0}, "need kl_coef >= 0"),
    ({"value_clip": 0.0}, "value_clip > 0"),
    ({"prompts_per_step": 2, "minibatches": 3}, r"minibatches \(3\) > rollouts per step \(2\)"),
    ({"clip_low": 1.1}, "clip_low <= 1 <= clip_high"),
])
def test_ppo_config_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PPOConfig(**kwargs)


def test_digit_sum_partial_credit(digit_model_dir):
    tok = load_tokenizer(digit_model_dir)
    task = DigitSumTask(tok)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    strict, graded = DigitSumEnv(task), make_env(tok, partial_credit=True, max_digits=4)
    p = task.problem(40913)
    assert graded.task.max_digits == 4 and graded.partial_credit and not strict.partial_credit
    for completion, want_strict, want_graded in [
        (enc(" 17") + [task.eos], 1.0, 1.0),
        (enc(" 18") + [task.eos], 0.0, PARTIAL_CREDIT),  # wrong but an integer
        (enc("5"), 0.0, PARTIAL_CREDIT),  # truncated (no EOS) integers count too
        (enc(" 1 7") + [task.eos], 0.0, 0.0),
        (enc(" Sum") + [task.eos], 0.0, 0.0),
        ([task.eos], 0.0, 0.0),
    ]:
        assert strict.reward(p, completion) == want_strict, tok.decode(completion)
        assert graded.reward(p, completion) == want_graded, tok.decode(completion)


def test_bt_loss_value_and_gradient_match_autograd_of_the_formula():
    import torch

    from ember.recipes.reward_model import bt_loss

    torch.manual_seed(0)
    values = [torch.randn(n, dtype=torch.float64, requires_grad=True) for n in (3, 5, 2, 4)]
    loss, metrics = bt_loss([], values)
    loss.backward()
    s = [v.detach()[-1] for v in values]
    want = (torch.log1p(torch.exp(-(s[0] - s[1]))) + torch.log1p(torch.exp(-(s[2] - s[3])))) / 2
    assert loss.item() == pytest.approx(float(want), abs=1e-12)
    for j, v in enumerate(values):  # only the last position carries gradient
        sign = 1.0 if j % 2 == 0 else -1.0
        c, r = s[j - j % 2], s[j - j % 2 + 1]
        expected_last = -sign * torch.sigmoid(-(c - r)) / 2
        assert float(v.grad[-1]) == pytest.approx(float(expected_last), abs=1e-12)
        assert torch.count_nonzero(v.grad[:-1]) == 0
    assert metrics["accuracy"] == pytest.approx(((s[0] > s[1]).item() + (s[2] > s[3]).item()) / 2)


def test_preference_data(digit_model_dir, tmp_path):
    from ember.recipes.reward_model import RMConfig, jsonl_pairs, load_pairs, pair_datums, synthetic_digits

    tok = load_tokenizer(digit_model_dir)
    pairs = synthetic_digits(tok, 20, seed=3)
    assert pairs == synthetic_digits(tok, 20, seed=3)  # reproducible
    for prompt, chosen, rejected in pairs:
        assert len(chosen) == len(rejected) and chosen[-1] == rejected[-1] == tok.eos_token_id
        assert tok.decode(chosen[:-1]).strip().isdigit() and tok.decode(rejected[:-1]).strip().isalpha()
    train, held = load_pairs(RMConfig(train_pairs=30, eval_pairs=10), tok)
    assert len(train) == 30 and len(held) == 10
    assert not {tuple(p) for p, _, _ in train} & {tuple(p) for p, _, _ in held}  # distinct numbers
    d = pair_datums(pairs[:2])
    assert [x.model_input.to_ints() for x in d] == [pairs[0][0] + pairs[0][1], pairs[0][0] + pairs[0][2],
                                                  pairs[1][0] + pairs[1][1], pairs[1][0] + pairs[1][2]]
    path = tmp_path / "prefs.jsonl"
    path.write_text(json.dumps({"prompt": "Sum the digits of 12:", "chosen": " 3", "rejected": " e"}) + "\n\n")
    [(p, c, r)] = jsonl_pairs(path, tok)
    assert tok.decode(p) == "Sum the digits of 12:" and c[-1] == r[-1] == tok.eos_token_id
    with pytest.raises(ValueError, match="has 1 pairs; need more than eval_pairs"):
        load_pairs(RMConfig(data=str(path), eval_pairs=1), tok)
    path.write_text(json.dumps({"prompt": "x", "chosen": " 3"}) + "\n")
    with pytest.raises(ValueError, match=r"prefs.jsonl:1: expected non-empty strings 'prompt', 'chosen', 'rejected'"):
        jsonl_pairs(path, tok)
    with pytest.raises(FileNotFoundError, match="no preference data named 'nope.jsonl'.*synthetic_digits"):
        load_pairs(RMConfig(data="nope.jsonl"), tok)
    with pytest.raises(ValueError, match="RMConfig.pairs_per_step must be >= 1, got 0"):
        RMConfig(pairs_per_step=0)
