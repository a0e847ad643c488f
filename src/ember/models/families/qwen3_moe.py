"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k RMSNorm per head)
with a sparse MLP in every layer: a router (`mlp.gate`, softmax over E experts, top-k,
`norm_topk_prob` renormalising the k weights) and E experts fused in two 3-D weights,
`mlp.experts.gate_up_proj` (E, 2I, H) and `mlp.experts.down_proj` (E, H, I), each applied
per expert with `F.linear` (out, in). Layers listed in `mlp_only_layers` keep a dense
MLP (`gate_proj`/`up_proj`/`down_proj`), which `train_mlp` targets as for Qwen3.

The hub publishes per-expert tensors (`mlp.experts.N.gate_proj.weight`, ...);
transformers' loader fuses them (its `qwen2_moe` conversion), so either layout loads.
No tensor parallelism and no direct decode (the sampler runs the transformers forward).
"""

from __future__ import annotations

from transformers import Qwen3MoeConfig

from ember.models.families.base import LoraTargets, ModelFamily, MoeLayout

MOE = MoeLayout(router="mlp.gate", num_experts="num_experts",
                per_expert=(("gate_proj", "gate_up_proj", 0, 2), ("up_proj", "gate_up_proj", 1, 2),
                            ("down_proj", "down_proj", 0, 1)))


def tiny_config(**kwargs) -> Qwen3MoeConfig:
    """4 experts, 2 per token, expert width 3/4 of the hidden size (so no expert weight is
    square: a transposition mistake cannot go unnoticed), top-k weights renormalised as
    in the published checkpoints."""
    hidden = int(kwargs["hidden_size"])
    return Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=max(1, 3 * hidden // 4),
                          norm_topk_prob=True, router_aux_loss_coef=0.0, **kwargs)


FAMILY = ModelFamily("qwen3_moe", tiny_config=tiny_config, tp_plan=None, decode=None, moe=MOE,
                     lora=LoraTargets(experts=MOE.param_paths),
                     value_head_class="Qwen3MoeForTokenClassification", head_qk_norm=True)
