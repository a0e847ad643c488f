"""The `Sampler` interface says what callers use (ember.sampling.base): every backend
implements it whole, every capability a caller relies on is declared there with a
default, and no caller probes a sampler with getattr/hasattr instead."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ember.sampling import Sampler, SamplerConfig, TorchSampler
from ember.sampling.pool import SamplerPool
from ember.sampling.registry import SAMPLER_BACKENDS

SRC = Path(__file__).resolve().parents[2] / "src" / "ember"
# What the service, the pool's replicas, weight sync and the metrics ask of any sampler.
CAPABILITIES = ("submit", "submit_many", "load_weights", "vocab_size", "close", "model", "max_len", "eos_token_ids",
                "default_max_tokens", "sleep", "sleep_stats", "replica_stats", "version_weights")
# getattr/hasattr whose object is a sampler (by the names callers give one)
PROBE = re.compile(r"\b(getattr|hasattr)\(\s*(self\.)?(sampler|backend|pool|s)\s*,")


class _Minimal(Sampler):
    """A backend with only the abstract methods: it gets every default."""

    def submit(self, request):
        raise NotImplementedError

    def load_weights(self, named_weights, lora_config=None, *, copy=True):
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        return 10

    def close(self) -> None:
        pass


def test_every_capability_is_declared_on_the_interface():
    missing = [name for name in CAPABILITIES if not hasattr(Sampler, name)]
    assert not missing, f"callers use these but ember.sampling.base.Sampler does not declare them: {missing}"


@pytest.mark.parametrize("cls", [TorchSampler, SamplerPool], ids=lambda c: c.__name__)
def test_each_backend_implements_the_whole_interface(cls):
    assert issubclass(cls, Sampler) and not cls.__abstractmethods__, sorted(cls.__abstractmethods__)


def test_every_registered_backend_is_a_sampler():
    from ember.registry import lookup

    for name in SAMPLER_BACKENDS:
        try:
            cls = lookup(SAMPLER_BACKENDS, name, "sampler backend")
        except ImportError:  # vLLM is optional: its class cannot be imported without it
            continue
        assert issubclass(cls, Sampler) and not cls.__abstractmethods__, (name, sorted(cls.__abstractmethods__))


def test_defaults_of_a_backend_without_the_capabilities():
    s = _Minimal()
    s.sleep()  # nothing to release: no error
    assert (s.sleep_stats, s.replica_stats(), s.max_len, s.eos_token_ids, s.model) == (None, None, None, (), None)
    assert s.default_max_tokens == SamplerConfig().default_max_tokens
    assert s.version_weights(object()) is None  # cannot hand a version's weights back


def test_a_backend_answers_its_configured_default_max_tokens(tiny_model_dir):
    with TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(max_slots=2, default_max_tokens=7)) as s:
        assert s.default_max_tokens == 7 and s.model is not None and s.replica_stats() is None


def test_no_caller_probes_a_sampler_with_getattr():
    hits = [f"{p.relative_to(SRC)}:{i}: {line.strip()}" for p in sorted(SRC.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if PROBE.search(line)]
    assert not hits, "declare the capability on ember.sampling.base.Sampler instead:\n" + "\n".join(hits)
