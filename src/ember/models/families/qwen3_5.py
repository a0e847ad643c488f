"""Qwen3.5 (dense): a hybrid decoder whose layers are Gated DeltaNet linear attention
(`linear_attention`) with a full-attention layer every fourth (`full_attention`; Qwen3-style
q/k norms and a sigmoid output gate folded into `q_proj`).

Checkpoints. A published Qwen3.5 directory is a vision-language checkpoint: config.json has
`model_type: "qwen3_5"` (`Qwen3_5ForConditionalGeneration`, a `text_config` of type
`qwen3_5_text` and a `vision_config`) and its weights are `model.language_model.*`,
`model.visual.*`, `lm_head.*` and `mtp.*`. ember loads it text-only: `AutoModelForCausalLM`
maps `qwen3_5` to `Qwen3_5ForCausalLM` over the text config, transformers' own weight
renaming drops the `language_model` prefix and its load ignores the tower and the MTP head.
The loaded model's config (and the tiny model's) is the text config, `qwen3_5_text`: both
model types are this family (`config_types`).

A linear-attention layer keeps per-sequence state (`docs/architecture.md#hybrid-linear-attention-qwen35`):
a short causal convolution over q/k/v (`linear_conv_kernel_dim` columns) and the delta-rule
matrix (`linear_num_value_heads` x key dim x value dim). transformers' torch kernels take no
sequence boundaries, so the engine does not pack this family (one sequence per row), the
sampler keeps the state beside each slot's KV (`ember.sampling.kv_cache`) and turns its
prefix cache off, and context parallelism is refused.

LoRA targets: the full-attention layers' q/k/v/o as every family, and in the linear layers
`in_proj_qkv` (the delta rule's q/k/v, before the convolution), `in_proj_z` (the output
gate, the counterpart of the gate half of `q_proj`) and `out_proj`. `in_proj_a` / `in_proj_b`
(the per-head decay and write strength) are left out: they output one value per head
(32 in Qwen3.5-9B), so a rank-r adapter on them has about as many weights as the matrix
itself and is not low-rank at all; full fine-tuning trains them.

No tensor parallelism (the linear layers' projections do not split as Llama's plan does),
no direct decode, no value-head export (transformers' `Qwen3_5ForTokenClassification`
takes the vision-language config).
"""

from __future__ import annotations

from transformers import Qwen3_5TextConfig

from ember.models.families.base import LoraTargets, ModelFamily

FULL_ATTENTION_INTERVAL = 4  # Qwen3.5's layout: three linear layers, then one full-attention layer


def layer_types(num_layers: int) -> list[str]:
    """Qwen3.5's pattern (every fourth layer full attention), with the last layer full
    attention too, so a model of fewer than four layers still has one."""
    return ["full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 or i == num_layers - 1
            else "linear_attention" for i in range(num_layers)]


def tiny_config(**kwargs) -> Qwen3_5TextConfig:
    """The linear layers use the attention's head size, and half as many key heads as value
    heads, as Qwen3.5 does (16 and 32); the convolution is Qwen3.5's 4 columns."""
    heads, head_dim = int(kwargs["num_attention_heads"]), int(kwargs["head_dim"])
    return Qwen3_5TextConfig(
        layer_types=layer_types(int(kwargs["num_hidden_layers"])),
        linear_num_value_heads=heads, linear_num_key_heads=max(1, heads // 2),
        linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, linear_conv_kernel_dim=4,
        **kwargs,
    )


LORA = LoraTargets(attn=("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj"))

FAMILY = ModelFamily("qwen3_5", tiny_config=tiny_config, tp_plan=None, lora=LORA, decode=None,
                     value_head_class=None, config_types=("qwen3_5_text",))
