"""Qwen2: Llama's layer with q/k/v biases; a window only with `config.use_sliding_window`."""

from __future__ import annotations

from transformers import Qwen2Config

from ember.models.families.base import ModelFamily


def tiny_config(**kwargs) -> Qwen2Config:
    return Qwen2Config(**kwargs)


FAMILY = ModelFamily("qwen2", tiny_config=tiny_config, value_head_class="Qwen2ForTokenClassification")
