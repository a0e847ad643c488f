"""Qwen3.5-MoE (Qwen3.5-35B-A3B, Qwen3.5-397B-A17B): Qwen3.5's hybrid decoder (Gated DeltaNet
linear-attention layers, a full-attention layer every fourth; see `qwen3_5.py`) with a sparse
MLP in every layer: a router (`mlp.gate`, softmax over E experts, top-k renormalised), E
experts fused as in Qwen3-MoE (`mlp.experts.gate_up_proj` (E, 2I, H), `mlp.experts.down_proj`
(E, H, I), `F.linear` per expert) and, beside them, a dense shared expert
(`mlp.shared_expert.{gate,up,down}_proj`) scaled by a sigmoid gate (`mlp.shared_expert_gate`,
one output).

Checkpoints. As for Qwen3.5, a published directory is a vision-language checkpoint
(`model_type: "qwen3_5_moe"`, `Qwen3_5MoeForConditionalGeneration`, a `text_config` of type
`qwen3_5_moe_text`, weights under `model.language_model.*` beside `model.visual.*` and
`mtp.*`); `AutoModelForCausalLM` loads it text-only as `Qwen3_5MoeForCausalLM`, whose config
is the text config (`config_types`). transformers' loader renames the prefix and fuses
per-expert tensors (`mlp.experts.N.gate_proj.weight`, ...; its `qwen2_moe` conversion), so
either expert layout loads; `save_pretrained` (and so `export_hf`) writes per-expert tensors.

LoRA targets: Qwen3.5's (full-attention q/k/v/o, the linear layers' `in_proj_qkv`,
`in_proj_z`, `out_proj`), the shared expert's gate/up/down (`train_mlp`'s dense names) and
every routed expert (per-expert A/B on the fused weights, `ember.models.experts`). The router
and the shared-expert gate (one output: a rank-r adapter on it is no smaller than the
matrix) are trained by full fine-tuning only.

What Qwen3.5 refuses this family refuses for the same reason: no packing (one sequence per
row), no context parallelism, no vLLM backend (`ember.sampling.vllm_support`); and, as for
every MoE family, no tensor parallelism, no direct decode and no value-head export
(transformers has no token classifier for it).
"""

from __future__ import annotations

from transformers import Qwen3_5MoeTextConfig

from ember.models.families.base import LoraTargets, ModelFamily
from ember.models.families.qwen3_5 import LORA as QWEN3_5_LORA
from ember.models.families.qwen3_5 import layer_types
from ember.models.families.qwen3_moe import MOE


def tiny_config(**kwargs) -> Qwen3_5MoeTextConfig:
    """Qwen3.5's tiny linear layers (`qwen3_5.tiny_config`), 4 experts, 2 per token, routed
    and shared expert width 3/4 of the hidden size (no square expert weight)."""
    heads, head_dim = int(kwargs["num_attention_heads"]), int(kwargs["head_dim"])
    width = max(1, 3 * int(kwargs["hidden_size"]) // 4)
    kwargs.pop("intermediate_size", None)  # no dense MLP: the shared expert has its own width
    return Qwen3_5MoeTextConfig(
        layer_types=layer_types(int(kwargs["num_hidden_layers"])),
        linear_num_value_heads=heads, linear_num_key_heads=max(1, heads // 2),
        linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=width, shared_expert_intermediate_size=width,
        router_aux_loss_coef=0.0, **kwargs,
    )


LORA = LoraTargets(attn=QWEN3_5_LORA.attn, experts=MOE.param_paths)

FAMILY = ModelFamily("qwen3_5_moe", tiny_config=tiny_config, tp_plan=None, lora=LORA, decode=None, moe=MOE,
                     value_head_class=None, config_types=("qwen3_5_moe_text",))
