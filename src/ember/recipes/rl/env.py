"""The RL environment interface of the GRPO and PPO recipes: prompts in, completions scored.

An environment hands out problems (a tokenized prompt plus whatever the verifier needs)
and scores a sampled completion. Single-turn, verifier-based: that is all GRPO and PPO need.
The environments a config can name are in `ember.recipes.rl.environments`.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One prompt: its tokens, its text (for display) and the verifier's reference."""

    tokens: tuple[int, ...]
    text: str
    reference: Any = None


class Environment(abc.ABC):
    """Prompts -> completions -> rewards."""

    @abc.abstractmethod
    def sample_problems(self, n: int, rng: random.Random) -> list[Problem]:
        """`n` fresh training problems (unlabelled as far as the learner is concerned)."""

    @abc.abstractmethod
    def reward(self, problem: Problem, completion_tokens: Sequence[int]) -> float:
        """Score one sampled completion (its tokens, including the stop token if any)."""

    def stop(self) -> list[int] | list[str] | None:
        """Stop condition for sampling; None = the model's EOS (Tinker's default)."""
        return None
