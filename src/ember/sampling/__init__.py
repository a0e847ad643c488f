"""Sampling: the `Sampler` interface and `TorchSampler` (KV cache, continuous batching,
Tinker's sampling semantics, versioned weights). See `ember.sampling.base` for the
semantics every backend implements."""

from ember.sampling.base import Sampler, SamplingRequest, WeightVersion
from ember.sampling.config import DEFAULT_MAX_TOKENS, SamplerConfig, resolve_sampler_config
from ember.sampling.registry import SAMPLER_BACKENDS, create_sampler


def __getattr__(name: str):
    # TorchSampler pulls in transformers; keep `import ember.sampling` light.
    if name == "TorchSampler":
        from ember.sampling.torch_sampler import TorchSampler

        return TorchSampler
    if name == "VLLMSampler":
        from ember.sampling.vllm_sampler import VLLMSampler

        return VLLMSampler
    if name == "TorchWeightVersion":
        from ember.sampling.weights import TorchWeightVersion

        return TorchWeightVersion
    raise AttributeError(f"module 'ember.sampling' has no attribute {name!r}")


__all__ = [
    "DEFAULT_MAX_TOKENS",
    "SAMPLER_BACKENDS",
    "Sampler",
    "SamplerConfig",
    "SamplingRequest",
    "TorchSampler",
    "TorchWeightVersion",
    "VLLMSampler",
    "WeightVersion",
    "create_sampler",
    "resolve_sampler_config",
]
