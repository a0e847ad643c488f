"""Llama: the reference layout (pre-norm layer, gated MLP, separate q/k/v projections)."""

from __future__ import annotations

from transformers import LlamaConfig

from ember.models.families.base import ModelFamily


def tiny_config(**kwargs) -> LlamaConfig:
    return LlamaConfig(**kwargs)


FAMILY = ModelFamily("llama", tiny_config=tiny_config, value_head_class="LlamaForTokenClassification")
