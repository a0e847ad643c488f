"""What the RL recipes (`ember.recipes.grpo`, `ember.recipes.ppo`) share.

- `env`: the `Environment` interface and its `Problem`;
- `environments`: the environments a config names (`env = "digit_sum"`);
- `config`: `RLConfig`, the fields and checks both recipes' configs have;
- `rollouts`: sampling G completions per problem and scoring them (`Rollout`);
- `reference`: a reference sampler's log-probs of sampled completions;
- `advantages`: group-relative advantages (GRPO), per-token rewards, GAE and whitening (PPO),
  the k1/k3 KL estimators and KL-shaped advantages.

Importing this package is cheap; the submodules import what they need.
"""
