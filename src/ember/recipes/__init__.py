"""Recipes on the public Tinker API: flat SFT and GRPO loops, the digit-sum demo.

`ember.recipes.sft` and `ember.recipes.grpo` use only `ServiceClient` /
`TrainingClient` / `SamplingClient` methods, so they run unchanged on
`ember.ServiceClient()` and on the official `tinker.ServiceClient(base_url=...)`.
Importing this package is cheap; the submodules import what they need.
"""
