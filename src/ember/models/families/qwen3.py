"""Qwen3: Llama's layer with an RMSNorm on each query and key head (`q_norm`, `k_norm`),
which tensor parallelism applies to the local heads (`LLAMA_TP_PLAN.head_norms`)."""

from __future__ import annotations

from transformers import Qwen3Config

from ember.models.families.base import DirectDecode, ModelFamily


def tiny_config(**kwargs) -> Qwen3Config:
    return Qwen3Config(**kwargs)


FAMILY = ModelFamily("qwen3", tiny_config=tiny_config, decode=DirectDecode(qk_norm="head"),
                     value_head_class="Qwen3ForTokenClassification")
