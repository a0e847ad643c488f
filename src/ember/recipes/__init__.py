"""Recipes on the public Tinker API: flat SFT, GRPO, PPO and reward-model loops, the digit-sum demo.

What GRPO and PPO share (environments, rollouts, advantages, `RLConfig`) is in `ember.recipes.rl`.

`ember.recipes.sft` and `ember.recipes.grpo` use only `ServiceClient` /
`TrainingClient` / `SamplingClient` methods, so they run unchanged on
`ember.ServiceClient()` and on the official `tinker.ServiceClient(base_url=...)`.
Importing this package is cheap; the submodules import what they need.
"""
