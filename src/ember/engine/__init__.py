"""Training engines: the `TrainingEngine` interface and `TorchEngine` (HF model + AdamW).

Each name is imported on first use (`ember.registry.lazy_exports`): `ember.engine.config`
loads without torch.
"""

from ember.registry import lazy_exports

_EXPORTS = {
    "EngineConfig": "ember.engine.config",
    "EngineInfo": "ember.engine.base",
    "EngineStatus": "ember.engine.base",
    "NonFiniteGradientError": "ember.engine.base",
    "TorchEngine": "ember.engine.torch_engine",
    "TrainingEngine": "ember.engine.base",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
