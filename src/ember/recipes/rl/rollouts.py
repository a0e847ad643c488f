"""Rollouts: G sampled completions per problem, each scored by the environment.

Every `sample` request is submitted before any is awaited, so the sampler batches them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from tinker import types

from ember.recipes.rl.env import Environment, Problem


@dataclass
class Rollout:
    """One sampled completion of a problem: its tokens, the sampler's log-probs of them, its reward."""

    problem: Problem
    tokens: list[int]
    logprobs: list[float]
    reward: float
    ref_logprobs: list[float] | None = None  # the reference's log-probs of `tokens` (kl_coef > 0)


def submit_samples(
    sampling_client, problems: Sequence[Problem], n: int, params: types.SamplingParams,
    rng: random.Random | None = None,
) -> list:
    """One `sample` request per problem, all submitted before any is awaited.

    With `rng`, each request gets its own sampling seed (reproducible runs).
    """
    futures = []
    for p in problems:
        req_params = params if rng is None else params.model_copy(update={"seed": rng.randrange(2**31)})
        futures.append(sampling_client.sample(types.ModelInput.from_ints(list(p.tokens)), n, req_params))
    return futures


def collect_groups(env: Environment, problems: Sequence[Problem], futures: Sequence) -> list[list[Rollout]]:
    groups = []
    for problem, future in zip(problems, futures):
        seqs = future.result().sequences
        groups.append([Rollout(problem, list(s.tokens), list(s.logprobs or []), env.reward(problem, s.tokens))
                       for s in seqs])
    return groups


def evaluate_greedy(sampling_client, env: Environment, problems: Sequence[Problem], max_tokens: int) -> float:
    """Mean reward of greedy (temperature 0) completions: exact-match accuracy for 0/1 rewards."""
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=env.stop())
    groups = collect_groups(env, problems, submit_samples(sampling_client, problems, 1, params))
    return sum(g[0].reward for g in groups) / len(groups)
