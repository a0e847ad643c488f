"""The environments an RL config can name: `env = NAME`, `env_args = {...}` (`ember train grpo|ppo`).

A registry of its own (not in `env`): an environment module imports the `Environment`
interface, and this registry imports the environment modules.
"""

from __future__ import annotations

from typing import Any

from ember.recipes.digit_sum import make_env as make_digit_sum_env
from ember.recipes.rl.env import Environment

# name -> factory(tokenizer, **env_args)
ENVIRONMENTS: dict[str, Any] = {"digit_sum": make_digit_sum_env}


def check_env_name(name: str, owner: str) -> None:
    """ValueError naming `<owner>.env` and the known names when `name` is not one of them."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"{owner}.env: unknown environment {name!r}; known: {sorted(ENVIRONMENTS)}")


def make_env(name: str, tokenizer: Any, env_args: dict[str, Any]) -> Environment:
    return ENVIRONMENTS[name](tokenizer, **env_args)
