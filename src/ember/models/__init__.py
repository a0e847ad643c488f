"""Model loading (HF `from_pretrained` from local directories), LoRA via peft, tiny test models."""

from ember.models.loading import load_model, load_tokenizer, resolve_dtype
from ember.models.lora import LORA_ALPHA, apply_lora, lora_target_modules

__all__ = [
    "LORA_ALPHA",
    "apply_lora",
    "load_model",
    "load_tokenizer",
    "lora_target_modules",
    "resolve_dtype",
]
