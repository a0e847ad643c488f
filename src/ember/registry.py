"""The one loader of ember's registries: plain dicts of name -> "module:Name" reference.

Engine backends, sampler backends, worker runtimes, recipes and `ember` subcommands are
named in such dicts and imported on first use, so an optional dependency (vLLM, Ray) is
only imported when asked for:

    engine_cls = lookup(ENGINE_BACKENDS, "torch", "engine backend")
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
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
