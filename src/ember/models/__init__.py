"""Model loading (HF `from_pretrained` from local directories), LoRA via peft (and the adapter
directory writer, `ember.models.adapter`), tiny test models."""

from ember.models.adapter import write_peft_adapter
from ember.models.loading import load_model, load_tokenizer, resolve_dtype
from ember.models.lora import LORA_ALPHA, add_lora_adapter, apply_lora, lora_target_modules, remove_lora_adapter

__all__ = [
    "LORA_ALPHA",
    "add_lora_adapter",
    "remove_lora_adapter",
    "apply_lora",
    "load_model",
    "load_tokenizer",
    "lora_target_modules",
    "resolve_dtype",
    "write_peft_adapter",
]
