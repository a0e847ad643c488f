"""Typed dataclass configs from TOML files and `--section.key value` command-line overrides.

Each component owns its config dataclass (`EngineConfig`, `SFTConfig`, ...) and validates
it in `__post_init__`; this module only fills such dataclasses, checking every key and
type on the way in:

    cfg = load_config(SFTConfig, "sft.toml", ["--lr", "3e-4", "--metrics.tensorboard=false"])

* Tables map to nested dataclass fields; dotted override keys address them
  (`--engine.micro_batch_tokens 8192`).
* Supported field types: bool, int, float (ints accepted), str, Path, Literal[...],
  X | None, list[X], tuple[X, ...], dict[str, X] and nested dataclasses.
* Override values are parsed according to the field type (`true`/`false` for bools,
  TOML literals such as `[1, 2]` for lists and `{a = "b"}` for dicts).
* Every problem is a `ConfigError` (a ValueError) naming the dotted key: unknown key
  (with the valid keys listed), wrong type, missing required key, missing or invalid
  file, and `__post_init__` failures (with the section named).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types as pytypes
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key."""


class _CliValue(str):
    """A value typed on the command line: parsed according to the target field's type."""


def load_config(cls: type[T], path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> T:
    """Build `cls` from an optional TOML file plus `--key value` / `--key=value` overrides."""
    raw = read_toml(path) if path is not None else {}
    for key, value in parse_overrides(overrides).items():
        _set_dotted(raw, key, value)
    where = f" (in {path})" if path is not None else ""
    return from_dict(cls, raw, where=where)


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {str(p)!r}")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None


def parse_overrides(args: Sequence[str]) -> dict[str, _CliValue]:
    """`["--a.b", "1", "--c=x"]` -> {"a.b": "1", "c": "x"}; anything else is a ConfigError."""
    out: dict[str, _CliValue] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) < 3:
            raise ConfigError(f"expected a config override like --section.key VALUE, got {arg!r}")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"config override --{key} needs a value")
            value = args[i + 1]
            i += 1
        out[key.replace("-", "_")] = _CliValue(value)
        i += 1
    return out


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key {'.'.join(parts[: depth + 1])!r} is a value, not a table")
        node = child
    node[parts[-1]] = value


def from_dict(cls: type[T], data: Mapping[str, Any], where: str = "", prefix: str = "") -> T:
    """Build dataclass `cls` from a mapping, recursively, naming bad keys with their dotted path."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"config key {prefix.rstrip('.') or '<root>'!r}{where}: expected a table, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        section = f"[{prefix.rstrip('.')}]" if prefix else "the top level"
        raise ConfigError(
            f"unknown config key {prefix + unknown[0]!r}{where}; valid keys in {section}: {', '.join(fields)}"
        )
    kwargs = {name: _coerce(data[name], hints[name], prefix + name, where) for name in fields if name in data}
    missing = [n for n, f in fields.items() if n not in data and _no_default(f)]
    if missing:
        raise ConfigError(f"missing required config key {prefix + missing[0]!r}{where}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        section = f"[{prefix.rstrip('.')}]" if prefix else cls.__name__
        raise ConfigError(f"invalid config {section}{where}: {e}") from None


def _no_default(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _fail(key: str, where: str, annotation: Any, value: Any) -> ConfigError:
    return ConfigError(
        f"config key {key!r}{where}: expected {_type_name(annotation)}, got {type(value).__name__} {str(value)!r}"
    )


def _coerce(value: Any, annotation: Any, key: str, where: str) -> Any:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if dataclasses.is_dataclass(annotation):
        return from_dict(annotation, value, where, prefix=key + ".")
    if origin in (typing.Union, pytypes.UnionType):
        return _coerce_union(value, args, annotation, key, where)
    if origin is typing.Literal:
        for choice in args:
            if value == choice or (isinstance(value, _CliValue) and str(choice) == value):
                return choice
        raise ConfigError(f"config key {key!r}{where}: expected one of {list(args)}, got {value!r}")
    if origin in (list, tuple, dict):
        return _coerce_container(value, annotation, origin, args, key, where)
    if annotation is Any:
        return value
    return _coerce_scalar(value, annotation, key, where)


def _coerce_union(value: Any, args: tuple, annotation: Any, key: str, where: str) -> Any:
    if type(None) in args and (value is None or (isinstance(value, _CliValue) and value.lower() in ("none", "null"))):
        return None
    for arg in (a for a in args if a is not type(None)):
        try:
            return _coerce(value, arg, key, where)
        except ConfigError:
            continue
    raise _fail(key, where, annotation, value)


def _coerce_container(value: Any, annotation: Any, origin: type, args: tuple, key: str, where: str) -> Any:
    if isinstance(value, _CliValue):
        value = _parse_toml_literal(value, key)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise _fail(key, where, annotation, value)
        value_tp = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(v, value_tp, f"{key}.{k}", where) for k, v in value.items()}
    if not isinstance(value, (list, tuple)):
        raise _fail(key, where, annotation, value)
    item_tp = args[0] if args else Any
    items = [_coerce(v, item_tp, f"{key}[{i}]", where) for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


def _parse_toml_literal(text: str, key: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        raise ConfigError(f"config key {key!r}: cannot parse {text!r} as a TOML value") from None


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _coerce_scalar(value: Any, annotation: Any, key: str, where: str) -> Any:
    if isinstance(value, _CliValue):
        return _parse_cli_scalar(str(value), annotation, key, where)
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif annotation is str:
        if isinstance(value, str):
            return value
    elif annotation is Path:
        if isinstance(value, str):
            return Path(value)
    else:
        raise ConfigError(f"config key {key!r}: field type {_type_name(annotation)} is not supported by ember.config")
    raise _fail(key, where, annotation, value)


def _parse_cli_scalar(text: str, annotation: Any, key: str, where: str) -> Any:
    try:
        if annotation is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError
        if annotation is int:
            return int(text)
        if annotation is float:
            return float(text)
        if annotation is str:
            return text
        if annotation is Path:
            return Path(text)
    except ValueError:
        raise _fail(key, " (command line)", annotation, text) from None
    raise ConfigError(f"config key {key!r}: field type {_type_name(annotation)} is not supported by ember.config")


def to_dict(obj: Any) -> dict[str, Any]:
    """A dataclass config as plain dicts (Paths as strings), e.g. to save beside a run."""
    def convert(v: Any) -> Any:
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, dict):
            return {k: convert(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [convert(x) for x in v]
        return v

    return convert(dataclasses.asdict(obj))


def describe_keys(cls: type, prefix: str = "") -> list[str]:
    """One line per settable key of `cls`: `--dotted.key TYPE (default: VALUE)`, nested
    sections expanded, for `--help` texts that stay true as the dataclasses change."""
    hints = typing.get_type_hints(cls)
    lines: list[str] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        annotation = hints[f.name]
        if dataclasses.is_dataclass(annotation):
            lines.extend(describe_keys(annotation, prefix + f.name + "."))
            continue
        if _no_default(f):
            default = "required"
        else:
            value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            default = f"default: {value!r}"
        lines.append(f"--{prefix}{f.name} {_key_type(annotation)} ({default})")
    return lines


def _key_type(annotation: Any) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(annotation)) + "}"
    return _type_name(annotation)
