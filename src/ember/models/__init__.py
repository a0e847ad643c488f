"""Model loading (HF `from_pretrained` from local directories), LoRA via peft (and the adapter
directory writer, `ember.models.adapter`), tiny test models.

Each name is imported on first use (`ember.registry.lazy_exports`): a light submodule
(`ember.models.dtypes`) loads without torch, transformers or peft.
"""

from ember.registry import lazy_exports

_EXPORTS = {
    "LORA_ALPHA": "ember.models.lora",
    "add_lora_adapter": "ember.models.lora",
    "apply_lora": "ember.models.lora",
    "load_model": "ember.models.loading",
    "load_tokenizer": "ember.models.loading",
    "lora_target_modules": "ember.models.lora",
    "remove_lora_adapter": "ember.models.lora",
    "resolve_dtype": "ember.models.loading",
    "write_peft_adapter": "ember.models.adapter",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
