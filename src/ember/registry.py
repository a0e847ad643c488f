"""The one loader of ember's registries: plain dicts of name -> "module:Name" reference.

Engine backends, sampler backends, worker runtimes, recipes and `ember` subcommands are
named in such dicts and imported on first use, so an optional dependency (vLLM, Ray) is
only imported when asked for:

    engine_cls = lookup(ENGINE_BACKENDS, "torch", "engine backend")
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def load(ref: str) -> Any:
    """What "package.module:Name" (or "package.module:Name.attr") names; "package.module"
    alone is the module. ImportError / AttributeError when it is not there."""
    module_name, sep, attr = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split(".") if sep else ():
        obj = getattr(obj, part)
    return obj


def lookup(registry: Mapping[str, str], name: str, what: str) -> Any:
    """`load(registry[name])`; ValueError "unknown WHAT 'name'; known: a, b" for another name."""
    ref = registry.get(name)
    if ref is None:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(sorted(registry))}")
    return load(ref)


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's module `__getattr__` (PEP 562) that imports each exported name from the
    module `exports` names for it ("ember.service.api", or "ember.service.api:OtherName")
    on first use. A package `__init__` that exports this way costs nothing to import, so
    loading one light submodule (a config dataclass) never pulls in torch or tinker
    through its package: `ember serve` checks its settings before the heavy imports."""

    def __getattr__(name: str) -> Any:
        ref = exports.get(name)
        if ref is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module_name, _, attr = ref.partition(":")
        return load(f"{module_name}:{attr or name}")

    return __getattr__
