"""Advantages and KL estimates of the RL recipes: pure functions of rewards, values and log-probs.

GRPO: group-relative advantages A_i = r_i - mean(r_group) (optionally / std), shaped per
token by the KL to a reference (`kl_shaped_advantages`). PPO: per-token rewards (the KL
penalty per token, the task reward at the last token), GAE and whitening.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def group_advantages(rewards_G: Sequence[float], std_normalize: bool) -> list[float]:
    mean = sum(rewards_G) / len(rewards_G)
    adv = [r - mean for r in rewards_G]
    if std_normalize and len(rewards_G) > 1:
        std = statistics.pstdev(rewards_G)
        adv = [a / (std + 1e-6) for a in adv]
    return adv


def token_rewards(reward: float, q_T: Sequence[float], ref_T: Sequence[float] | None, kl_coef: float) -> list[float]:
    """r_t = -kl_coef * (log q_t - log ref_t) on the sampled tokens; the task reward lands on the last."""
    r_T = [0.0] * len(q_T)
    if kl_coef > 0 and ref_T is not None:
        r_T = [-kl_coef * k for k in kl_k1(q_T, ref_T)]
    r_T[-1] += reward
    return r_T


def gae(rewards_T: Sequence[float], values_T: Sequence[float], gamma: float,
        lam: float) -> tuple[list[float], list[float]]:
    """GAE: delta_t = r_t + gamma*V_{t+1} - V_t with V_T = 0; A_t = sum_l (gamma*lam)^l delta_{t+l};
    returns (A_T, R_T) with R_t = A_t + V_t."""
    if len(rewards_T) != len(values_T):
        raise ValueError(f"gae: {len(rewards_T)} rewards for {len(values_T)} values")
    adv_T, next_adv, next_value = [0.0] * len(rewards_T), 0.0, 0.0
    for t in reversed(range(len(rewards_T))):
        delta = rewards_T[t] + gamma * next_value - values_T[t]
        next_adv = adv_T[t] = delta + gamma * lam * next_adv
        next_value = values_T[t]
    return adv_T, [a + v for a, v in zip(adv_T, values_T)]


def whiten(values_N: Sequence[float]) -> list[float]:
    mean, std = statistics.fmean(values_N), statistics.pstdev(values_N)
    return [(x - mean) / (std + 1e-8) for x in values_N]


def kl_k1(sampler_logprobs_T: Sequence[float], ref_logprobs_T: Sequence[float]) -> list[float]:
    """Per-token k1 = log q - log p_ref on sampled tokens: its mean estimates KL(q || p_ref)."""
    _check_same_length(sampler_logprobs_T, ref_logprobs_T)
    return [float(q) - float(r) for q, r in zip(sampler_logprobs_T, ref_logprobs_T)]


def kl_k3(sampler_logprobs_T: Sequence[float], ref_logprobs_T: Sequence[float]) -> list[float]:
    """Per-token k3 = exp(r) - 1 - r, r = log p_ref - log q: unbiased, always >= 0, lower variance."""
    _check_same_length(sampler_logprobs_T, ref_logprobs_T)
    return [math.expm1(r) - r for r in (float(p) - float(q) for q, p in zip(sampler_logprobs_T, ref_logprobs_T))]


def _check_same_length(sampler_logprobs_T: Sequence[float], ref_logprobs_T: Sequence[float]) -> None:
    if len(sampler_logprobs_T) != len(ref_logprobs_T):
        raise ValueError(f"KL estimate: {len(sampler_logprobs_T)} sampler logprobs vs "
                         f"{len(ref_logprobs_T)} reference logprobs (expected equal lengths)")


def kl_shaped_advantages(
    advantages_N: Sequence[float], sampler_logprobs_N_T: Sequence[Sequence[float]],
    ref_logprobs_N_T: Sequence[Sequence[float]], kl_coef: float,
) -> list[list[float]]:
    """Per-token advantages A_i + kl_coef * (mean_k1 - k1_it), k1 = log q - log p_ref.

    The k1 penalty is a per-token reward -kl_coef*k1 (tinker-cookbook's
    `incorporate_kl_penalty`); centring on `mean_k1`, the mean over all N sequences'
    tokens, keeps the token-mean of the shaped advantages equal to that of `advantages_N`
    (no drift of the baseline). Ragged: sequence i has its own length T_i.
    """
    if kl_coef < 0 or not math.isfinite(kl_coef):
        raise ValueError(f"kl_shaped_advantages: kl_coef must be a finite number >= 0, got {kl_coef}")
    if not len(advantages_N) == len(sampler_logprobs_N_T) == len(ref_logprobs_N_T):
        raise ValueError(f"kl_shaped_advantages: {len(advantages_N)} advantages, {len(sampler_logprobs_N_T)} "
                         f"sampler and {len(ref_logprobs_N_T)} reference logprob lists (expected equal counts)")
    k1_N_T = [kl_k1(q, p) for q, p in zip(sampler_logprobs_N_T, ref_logprobs_N_T)]
    n_tokens = sum(len(k) for k in k1_N_T)
    mean_k1 = sum(sum(k) for k in k1_N_T) / n_tokens if n_tokens else 0.0
    return [[float(a) + kl_coef * (mean_k1 - k) for k in k1_T] for a, k1_T in zip(advantages_N, k1_N_T)]
