"""What GRPO and PPO share lives in `ember.recipes.rl` (environments, rollouts, the reference,
advantages, `RLConfig`): neither recipe imports the other, no recipe class takes the name of a
core interface, and a field both configs have is declared once."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

import ember.engine
import ember.sampling
import ember.service
from ember.recipes.grpo import GRPOConfig
from ember.recipes.ppo import PPOConfig
from ember.recipes.rl.config import RLConfig
from ember.recipes.rl.environments import ENVIRONMENTS, check_env_name

RECIPES = Path(importlib.util.find_spec("ember.recipes").origin).parent


def imported_modules(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_grpo_and_ppo_do_not_import_each_other():
    assert "ember.recipes.grpo" not in imported_modules(RECIPES / "ppo.py")
    assert "ember.recipes.ppo" not in imported_modules(RECIPES / "grpo.py")
    for path in (RECIPES / "rl").glob("*.py"):  # the shared code depends on neither recipe
        assert not imported_modules(path) & {"ember.recipes.grpo", "ember.recipes.ppo"}, path.name


def test_no_recipe_class_is_named_like_a_core_interface():
    core = {name for m in (ember.engine, ember.sampling, ember.service) for name in m.__all__}
    classes = {node.name: path.relative_to(RECIPES).as_posix()
               for path in RECIPES.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.ClassDef)}
    assert "PolicySnapshot" in classes  # the walk sees the recipes' classes
    assert {name: where for name, where in classes.items() if name in core} == {}


def test_shared_fields_are_declared_once_in_rlconfig():
    assert issubclass(GRPOConfig, RLConfig) and issubclass(PPOConfig, RLConfig)
    repeated = set(GRPOConfig.__annotations__) & set(PPOConfig.__annotations__)
    # `minibatches` means a different split in each (GRPO: by group per batch; PPO: by rollout per epoch)
    assert repeated == {"minibatches"}
    assert set(PPOConfig.__annotations__) & set(RLConfig.__annotations__) == {"steps"}  # another default: 50
    assert (GRPOConfig().steps, PPOConfig().steps) == (100, 50)
    assert not set(GRPOConfig.__annotations__) & set(RLConfig.__annotations__)


@pytest.mark.parametrize("cls", [GRPOConfig, PPOConfig])
@pytest.mark.parametrize("field", ["lora_rank", "steps", "prompts_per_step", "max_tokens"])
def test_shared_checks_name_the_recipes_config(cls, field):
    with pytest.raises(ValueError, match=rf"^{cls.__name__}\.{field} must be >= 1, got 0$"):
        cls(**{field: 0})


@pytest.mark.parametrize("cls", [GRPOConfig, PPOConfig])
def test_clip_bounds_name_the_recipes_config(cls):
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: need 0 <= clip_low <= 1 <= clip_high, got 0.5, 0.9$"):
        cls(clip_low=0.5, clip_high=0.9)


def test_unknown_environment_names_the_config_and_the_known_ones():
    check_env_name("digit_sum", "GRPOConfig")
    with pytest.raises(ValueError, match=rf"^PPOConfig.env: unknown environment 'nope'; known: \['digit_sum'\]$"):
        check_env_name("nope", "PPOConfig")
    assert sorted(ENVIRONMENTS) == ["digit_sum"]
