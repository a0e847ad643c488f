"""Sampling: the `Sampler` interface and `TorchSampler` (KV cache, continuous batching,
Tinker's sampling semantics, versioned weights). See `ember.sampling.base` for the
semantics every backend implements.

Each name is imported on first use (`ember.registry.lazy_exports`): `ember.sampling.config`
and `ember.sampling.registry` load without torch or tinker.
"""

from ember.registry import lazy_exports

_EXPORTS = {
    "DEFAULT_MAX_TOKENS": "ember.sampling.config",
    "SAMPLER_BACKENDS": "ember.sampling.registry",
    "Sampler": "ember.sampling.base",
    "SamplerConfig": "ember.sampling.config",
    "SamplingRequest": "ember.sampling.base",
    "TorchSampler": "ember.sampling.torch_sampler",
    "TorchWeightVersion": "ember.sampling.weights",
    "VLLMSampler": "ember.sampling.vllm_sampler",
    "WeightVersion": "ember.sampling.base",
    "create_sampler": "ember.sampling.registry",
    "resolve_sampler_config": "ember.sampling.config",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
