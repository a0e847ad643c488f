"""Qwen3-VL: a ViT tower (patches of 16, 2x2 merge, DeepStack features added to the first
decoder layers) in front of a Qwen3 decoder with interleaved M-RoPE.

transformers' `Qwen3VLForConditionalGeneration` computes everything; what ember needs is
here: each image becomes `<|image_pad|>` x (merged patches) between `<|vision_start|>` and
`<|vision_end|>` (the chat template's placeholder; `ember.models.vision` expands it), the
M-RoPE position ids come from the model's own `get_rope_index` (which reads
`mm_token_type_ids` beside `input_ids`), LoRA targets the decoder's projections only.
No tensor parallelism and no direct decode: the engine and the sampler run the
transformers forward.
"""

from __future__ import annotations

from transformers import Qwen3VLConfig

from ember.models.families.base import ModelFamily, VisionFamily, vision_config_kwargs


def tiny_vision_config(out_hidden_size: int) -> dict:
    """A 2-block tower, hidden 32; DeepStack feeds block 0's features to decoder layer 0."""
    return dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=out_hidden_size,
                patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                deepstack_visual_indexes=[0])


VISION = VisionFamily(model_class="Qwen3VLForConditionalGeneration", tiny_vision_config=tiny_vision_config,
                      tiny_patch_size=16)


def tiny_config(*, vision_token_ids: dict[str, int], **kwargs) -> Qwen3VLConfig:
    top = vision_config_kwargs(kwargs, vision_token_ids)
    top["text_config"]["rope_parameters"]["mrope_interleaved"] = True
    return Qwen3VLConfig(vision_config=tiny_vision_config(int(kwargs["hidden_size"])), **top)


FAMILY = ModelFamily("qwen3_vl", tiny_config=tiny_config, tp_plan=None, decode=None, vision=VISION)
