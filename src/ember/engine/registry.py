"""Training-engine backends by name (`EngineConfig.backend`): a plain dict filled at import.

Values are "module:Class" paths imported on first use. A backend class implements
`ember.engine.base.TrainingEngine` and offers `from_pretrained(model_dir, config,
lora_config=None, *, model_name=..., parallelism=None, optimizer_config=None, head="policy")`. Adding a backend = one file + one
line here.
"""

from __future__ import annotations

from ember.registry import lookup

ENGINE_BACKENDS: dict[str, str] = {
    "torch": "ember.engine.torch_engine:TorchEngine",
}


def engine_class(name: str) -> type:
    return lookup(ENGINE_BACKENDS, name, "engine backend")
