"""`ember serve --config serve.toml`: one TOML file for every setting, the command line on top.

The file has the server's own keys at the top level (the long flag names with `_`:
`port`, `data_dir`, `api_key = [...]`, `model_root = [...]`, `[model]` NAME = "DIR",
`[client_config]`, ...) and one table per component config: `[engine]` (EngineConfig),
`[sampler]` (SamplerConfig), `[limits]` (Limits, per-request bounds), `[durability]` (database lock waits, future
finishing retries, the stuck-future sweep), `[stability]` (expiry and memory bounds of the
`record_stability_info` records), `[checkpoints]` (TTL sweep, metadata bounds), `[workers]`
(runtime, world_size, ray_address, call_timeout_s) and
`[parallel]` (dp_replicate, dp_shard, tp). `--engine.KEY` / `--sampler.KEY` flags are
generated from the dataclasses; every value goes through `ember.config`, so a bad key,
type or value is a ConfigError naming it. A flag given on the command line wins over the
file. `examples/serve.toml` lists every key.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import typing
from typing import Any

from ember.config import ConfigError, _CliValue, from_dict, read_toml

# section -> "module:Class", parsed into that dataclass by ember.config
COMPONENTS = {
    "engine": "ember.engine.config:EngineConfig",
    "sampler": "ember.sampling.config:SamplerConfig",
    "limits": "ember.service.limits:Limits",
    "durability": "ember.service.config:DurabilityConfig",
    "stability": "ember.service.stability:StabilityConfig",
    "checkpoints": "ember.service.config:CheckpointConfig",
}
COMPONENT_SECTIONS = tuple(COMPONENTS)
FLAG_SECTIONS = ("workers", "parallel")  # plain flags: --workers.runtime, --parallel.tp
REPEATED = {"model": "table", "api_key": "list", "client_config": "table", "model_root": "list"}
TOP_TYPES: dict[str, tuple[type, ...]] = {
    "models_toml": (str,), "host": (str,), "port": (int,), "data_dir": (str,), "database_url": (str,),
    "api_keys_file": (str,), "long_poll_s": (int, float), "max_body_mb": (int, float),
    "seq_gap_timeout_s": (int, float), "session_timeout_s": (int, float), "path_prefix": (str,),
    "request_log": (str,), "request_log_bodies": (str,), "log_level": (str,), "metrics_auth": (str,), "header_timeout_s": (int, float),
    "body_timeout_s": (int, float), "body_deadline_s": (int, float), "max_requests_per_key": (int,),
}


def component_class(section: str) -> type:
    module, _, name = COMPONENTS[section].partition(":")
    return getattr(importlib.import_module(module), name)


def field_types(cls: type) -> dict[str, str]:
    """A dataclass's fields and their types as written (for `--help`)."""
    hints = typing.get_type_hints(cls)
    return {f.name: str(hints[f.name]).replace("typing.", "").replace("<class '", "").replace("'>", "")
            for f in dataclasses.fields(cls)}


def add_component_flags(parser: argparse.ArgumentParser, section: str, title: str) -> None:
    """`--SECTION.NAME VALUE` for every field of the section's dataclass (parsed later)."""
    cls = component_class(section)
    group = parser.add_argument_group(title, (cls.__doc__ or "").strip().splitlines()[0])
    defaults = cls()
    for name, kind in field_types(cls).items():
        group.add_argument(f"--{section}.{name}", dest=f"{section}__{name}", default=None, metavar=kind.upper(),
                           help=f"default {getattr(defaults, name)!r}")


def component_config(args: argparse.Namespace, section: str):
    """The section's dataclass from the config file's table and the command-line flags."""
    cls = component_class(section)
    data: dict[str, Any] = dict(getattr(args, "_config_sections", {}).get(section, {}))
    prefix = f"{section}__"
    data.update({k[len(prefix):]: _CliValue(v) for k, v in vars(args).items()
                 if k.startswith(prefix) and v is not None})
    return from_dict(cls, data, prefix=f"{section}.")


def apply_config_file(args: argparse.Namespace, defaults: dict[str, Any]) -> None:
    """Fill `args` from `args.config` wherever the command line left the default."""
    if not getattr(args, "config", None):
        return
    doc = read_toml(args.config)
    where = f" (in {args.config})"
    args._config_sections = {}
    for key, value in doc.items():
        name = key.replace("-", "_")
        if name in COMPONENT_SECTIONS:
            args._config_sections[name] = _table(name, value, where)
        elif name in FLAG_SECTIONS:
            _apply_flag_section(args, defaults, name, _table(name, value, where), where)
        elif name in REPEATED:
            _apply_repeated(args, name, value, where)
        elif name in TOP_TYPES:
            _apply_scalar(args, defaults, name, value, where)
        else:
            valid = ", ".join([*TOP_TYPES, *REPEATED, *COMPONENT_SECTIONS, *FLAG_SECTIONS])
            raise ConfigError(f"unknown config key {key!r}{where}; valid keys: {valid}")


def _table(name: str, value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"config key {name!r}{where}: expected a table, got {value!r}")
    return value


def _apply_scalar(args, defaults, name: str, value: Any, where: str) -> None:
    kinds = TOP_TYPES[name]
    if isinstance(value, bool) or not isinstance(value, kinds):
        want = " or ".join(k.__name__ for k in kinds)
        raise ConfigError(f"config key {name!r}{where}: expected {want}, got {type(value).__name__} {value!r}")
    if getattr(args, name) == defaults[name]:  # the command line wins
        setattr(args, name, value)


def _apply_flag_section(args, defaults, section: str, table: dict, where: str) -> None:
    for key, value in table.items():
        dest = f"{section}__{key.replace('-', '_')}"
        if dest not in defaults:
            valid = ", ".join(d.split("__", 1)[1] for d in defaults if d.startswith(f"{section}__"))
            raise ConfigError(f"unknown config key '{section}.{key}'{where}; valid keys in [{section}]: {valid}")
        if getattr(args, dest) == defaults[dest]:
            setattr(args, dest, value)


def _apply_repeated(args, name: str, value: Any, where: str) -> None:
    """Tables and lists add to what the command line gave (its entries win on a clash)."""
    if REPEATED[name] == "list":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"config key {name!r}{where}: expected a list of strings, got {value!r}")
        setattr(args, name, [*value, *getattr(args, name)])
        return
    table = _table(name, value, where)
    if name == "model" and not all(isinstance(v, str) for v in table.values()):
        raise ConfigError(f"config key 'model'{where}: expected NAME = \"DIR\" strings, got {table!r}")
    setattr(args, name, [*table.items(), *getattr(args, name)])
