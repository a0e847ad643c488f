"""Qwen2.5-VL: a windowed ViT tower (patches of 14, 2x2 merge, SwiGLU MLPs, full attention
in `fullatt_block_indexes`) in front of a Qwen2 decoder with M-RoPE.

As Qwen3-VL (`qwen3_vl.py`): transformers' `Qwen2_5_VLForConditionalGeneration` computes
everything, images expand to `<|image_pad|>` runs, M-RoPE comes from the model's
`get_rope_index`. The tower's MLP is named like the decoder's (`gate_proj`, `up_proj`,
`down_proj`), so LoRA excludes the tower by module path (`VisionFamily.tower_pattern`),
not by suffix.
"""

from __future__ import annotations

from transformers import Qwen2_5_VLConfig

from ember.models.families.base import ModelFamily, VisionFamily, vision_config_kwargs


def tiny_vision_config(out_hidden_size: int) -> dict:
    """A 2-block tower, hidden 32; block 1 attends fully, block 0 in windows of 56 pixels."""
    return dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=out_hidden_size,
                patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                fullatt_block_indexes=[1])


VISION = VisionFamily(model_class="Qwen2_5_VLForConditionalGeneration", tiny_vision_config=tiny_vision_config,
                      tiny_patch_size=14)


def tiny_config(*, vision_token_ids: dict[str, int], **kwargs) -> Qwen2_5_VLConfig:
    return Qwen2_5_VLConfig(vision_config=tiny_vision_config(int(kwargs["hidden_size"])),
                            **vision_config_kwargs(kwargs, vision_token_ids))


FAMILY = ModelFamily("qwen2_5_vl", tiny_config=tiny_config, tp_plan=None, decode=None, vision=VISION)
