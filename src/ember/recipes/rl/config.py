"""`RLConfig`: the settings GRPO and PPO share, declared and checked once.

`GRPOConfig` and `PPOConfig` extend it (a recipe may give a field another default, as PPO
does `steps`); each message names the concrete class (`PPOConfig.lora_rank must be >= 1`),
so a TOML error still points at the recipe's own key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ember.metrics import MetricsConfig
from ember.recipes.common import ClientConfig


@dataclass
class RLConfig:
    base_model: str = ""
    init_from: str = ""  # the policy: a tinker:// save_state path to start from (e.g. an SFT run); empty: fresh LoRA
    lora_rank: int = 32
    steps: int = 100
    prompts_per_step: int = 16  # P
    max_tokens: int = 16
    temperature: float = 1.0
    learning_rate: float = 1e-4
    adam_beta2: float = 0.95  # Tinker's default; 0.999 smooths the noisy, sparse RL gradient
    clip_low: float = 0.8  # ppo ratio bounds (absolute, Tinker's convention)
    clip_high: float = 1.2
    kl_coef: float = 0.0  # beta >= 0: per-token KL penalty -beta*(log pi - log pi_ref) in the reward; 0 = no reference
    seed: int = 0
    env: str = "digit_sum"  # a name from ember.recipes.rl.environments.ENVIRONMENTS
    env_args: dict[str, Any] = field(default_factory=dict)
    run_dir: str = ""
    save_name: str = "final"
    client: ClientConfig = field(default_factory=ClientConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    # the int fields that must be >= 1; a recipe adds its own
    AT_LEAST_ONE: ClassVar[tuple[str, ...]] = ("lora_rank", "steps", "prompts_per_step", "max_tokens")

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name in self.AT_LEAST_ONE:
            if getattr(self, name) < 1:
                raise ValueError(f"{owner}.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.clip_low <= 1 <= self.clip_high:
            raise ValueError(f"{type(self).__name__}: need 0 <= clip_low <= 1 <= clip_high, got "
                             f"{self.clip_low}, {self.clip_high}")
