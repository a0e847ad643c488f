"""Mistral: Llama's layer; a non-null `config.sliding_window` means the window is in use."""

from __future__ import annotations

from transformers import MistralConfig

from ember.models.families.base import ModelFamily


def tiny_config(**kwargs) -> MistralConfig:
    # Full attention: the TorchSampler and the direct decoder serve windowed models only
    # through the transformers forward, so the tiny model keeps the common case.
    return MistralConfig(**kwargs, sliding_window=None)


FAMILY = ModelFamily("mistral", tiny_config=tiny_config, window_when_set=True,
                     value_head_class="MistralForTokenClassification")
