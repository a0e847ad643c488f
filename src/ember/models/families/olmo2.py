"""OLMo 2 (AllenAI): not Llama-shaped in two places, both handled here.

* The layer normalises each sublayer's *output* (`post_attention_layernorm`,
  `post_feedforward_layernorm`) before the residual add, and has no input norm.
* `q_norm` / `k_norm` are RMSNorms over the whole q / k projection (all heads together),
  applied before the split into heads; its RMSNorm multiplies by the weight before the
  cast back to the input dtype.

Tensor parallelism: none. A column split of q_proj would leave each rank normalising
over its own heads only, a different function (transformers' own plan gathers q/k/v
outputs for this reason); ember refuses `tp > 1` for OLMo 2 with that message rather
than compute something else.

Value head: transformers has no `Olmo2ForTokenClassification`, so a value-head run
exports as a training checkpoint or a peft adapter, not as a transformers model.

`Olmo2Config` has no `head_dim` field; the modeling code reads `config.head_dim` when
present, so the tiny model keeps it (and `hidden_size` need not be heads x head_dim).
"""

from __future__ import annotations

import torch
from transformers import Olmo2Config

from ember.models.families.base import DecodeOps, DirectDecode, ModelFamily


def post_norm_layer(ops: DecodeOps, h: torch.Tensor, i: int) -> torch.Tensor:
    """h + norm(attn(h)), then h + norm(mlp(h)) (h is the forward's own tensor)."""
    h = h + ops.norm(ops.attention(h, i), i, "post_attention_layernorm")
    return h.add_(ops.norm(ops.mlp(h, i), i, "post_feedforward_layernorm"))


def olmo2_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`Olmo2RMSNorm`: fp32 statistics, the weight applied before the cast back."""
    y = x.float()
    return (weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def tiny_config(**kwargs) -> Olmo2Config:
    return Olmo2Config(**kwargs)


FAMILY = ModelFamily(
    "olmo2",
    tiny_config=tiny_config,
    tp_plan=None,
    decode=DirectDecode(layer=post_norm_layer, qk_norm="projection", rms_norm=olmo2_rms_norm),
    value_head_class=None,
)
