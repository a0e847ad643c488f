"""Training engines: the `TrainingEngine` interface and `TorchEngine` (HF model + AdamW)."""

from ember.engine.base import EngineInfo, EngineStatus, NonFiniteGradientError, TrainingEngine
from ember.engine.config import EngineConfig


def __getattr__(name: str):
    # TorchEngine pulls in losses and peft; keep `import ember.engine` light.
    if name == "TorchEngine":
        from ember.engine.torch_engine import TorchEngine

        return TorchEngine
    raise AttributeError(f"module 'ember.engine' has no attribute {name!r}")


__all__ = ["EngineConfig", "EngineInfo", "EngineStatus", "NonFiniteGradientError", "TorchEngine", "TrainingEngine"]
