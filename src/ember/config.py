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
* List and dict fields are repeatable on the command line: `--api_key A --api_key B`
  adds two items, `--model NAME=DIR` one entry; a literal (`[...]`, `{...}`) replaces. What
  the command line adds goes on top of the file's list or table.
* Field metadata (`meta(...)`) shapes where a field's key lives, nothing else: `flat`
  (a nested dataclass whose keys sit at its parent's level), `section` (the field's key
  is in that table of its parent's level: `[parallel] tp`), `aliases` (older key names),
  `moved` (a `section` field whose key also reads at its parent's level, where it was
  before the section: `[sampler] max_loras` for `[sampler.vllm] max_loras`; on the
  command line both flags work, the one given there winning over the file) and `hidden`
  (not a setting: derived by the code).
* `settings(cls)` lists every key with its type, default and doc (the `name: text`
  entries of each class docstring); `add_arguments` turns them into argparse flags, so a
  field added to a dataclass is a TOML key, a flag and a `--help` line at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import tomllib
import collections.abc
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


class _CliRepeat(list):
    """The values of a flag given several times (items of a list or dict field)."""


@dataclasses.dataclass
class _OnTop:
    """A command-line value set over the file's value of the same key."""

    base: Any
    cli: Any


FLAT, SECTION, ALIASES, HIDDEN, LIMIT = "ember.flat", "ember.section", "ember.aliases", "ember.hidden", "ember.limit"
MOVED = "ember.moved"


def meta(*, flat: bool = False, section: str | None = None, aliases: Sequence[str] = (),
         hidden: bool = False, limit: bool = False, moved: bool = False) -> dict[str, Any]:
    """Field metadata for `dataclasses.field(metadata=meta(...))`: see the module docstring.
    `limit` marks a bound on what a request may ask for, outside `Limits` (the server's
    limits table lists it)."""
    out: dict[str, Any] = {}
    if limit:
        out[LIMIT] = True
    if flat:
        out[FLAT] = True
    if section:
        out[SECTION] = section
    if moved:
        if not section:
            raise ValueError("meta(moved=True) is for a field in a section (its old key is at the parent's level)")
        out[MOVED] = True
    if aliases:
        out[ALIASES] = tuple(aliases)
    if hidden:
        out[HIDDEN] = True
    return out


def load_config(cls: type[T], path: str | os.PathLike | None = None,
                overrides: Sequence[str] | Mapping[str, Any] = ()) -> T:
    """Build `cls` from an optional TOML file plus `--key value` / `--key=value` overrides
    (or a {dotted key: command-line value} mapping, as `overrides_from_args` gives)."""
    raw = _unalias(cls, read_toml(path)) if path is not None else {}
    pairs = overrides.items() if isinstance(overrides, Mapping) else parse_overrides(overrides).items()
    for key, value in pairs:
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


def parse_overrides(args: Sequence[str]) -> dict[str, Any]:
    """`["--a.b", "1", "--c=x"]` -> {"a.b": "1", "c": "x"}; anything else is a ConfigError.
    A key given twice keeps both values (a repeatable list or dict flag; else the last wins)."""
    out: dict[str, Any] = {}
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
        key = key.replace("-", "_")
        previous = out.get(key)
        if previous is None:
            out[key] = _CliValue(value)
        else:
            out[key] = _CliRepeat([*(previous if isinstance(previous, _CliRepeat) else [previous]), _CliValue(value)])
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
    last = parts[-1]
    old = node.get(last)
    node[last] = value if old is None or _is_cli(old) else _OnTop(old, value)


def _is_cli(value: Any) -> bool:
    return isinstance(value, (_CliValue, _CliRepeat, _OnTop))


def from_dict(cls: type[T], data: Mapping[str, Any], where: str = "", prefix: str = "",
              *, _check: bool = True) -> T:
    """Build dataclass `cls` from a mapping, recursively, naming bad keys with their dotted path."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"config key {prefix.rstrip('.') or '<root>'!r}{where}: expected a table, got {data!r}")
    data = _unalias(cls, data, deep=False)
    if _check:
        _check_keys(cls, data, prefix, where)
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    missing = []
    for f in _init_fields(cls):
        if f.metadata.get(FLAT):
            kwargs[f.name] = from_dict(hints[f.name], data, where, prefix, _check=False)
            continue
        section = f.metadata.get(SECTION)
        table = data.get(section, {}) if section else data
        key = f"{prefix}{section + '.' if section else ''}{f.name}"
        if f.name in table:
            kwargs[f.name] = _coerce(table[f.name], hints[f.name], key, where)
        elif _no_default(f):
            missing.append(key)
    if missing:
        raise ConfigError(f"missing required config key {missing[0]!r}{where}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        section = f"[{prefix.rstrip('.')}]" if prefix else cls.__name__
        raise ConfigError(f"invalid config {section}{where}: {e}") from None


def _init_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init and not f.metadata.get(HIDDEN)]  # type: ignore[arg-type]


def _level_keys(cls: type) -> dict[str, dict[str, None] | None]:
    """The keys a table of `cls` accepts: name -> None (a value or nested table) or, for a
    `section`, the keys inside it."""
    hints = typing.get_type_hints(cls)
    out: dict[str, dict[str, None] | None] = {}
    for f in _init_fields(cls):
        names = dict.fromkeys((f.name, *f.metadata.get(ALIASES, ())))
        if f.metadata.get(FLAT):
            for key, inner in _level_keys(hints[f.name]).items():
                out[key] = {**(out.get(key) or {}), **inner} if inner is not None else None
        elif f.metadata.get(SECTION):
            out[f.metadata[SECTION]] = {**(out.get(f.metadata[SECTION]) or {}), **names}
            if f.metadata.get(MOVED):
                out[f.name] = None
        else:
            out.update(dict.fromkeys(names))
    return out


def _check_keys(cls: type, data: Mapping[str, Any], prefix: str, where: str) -> None:
    accepted = _level_keys(cls)
    unknown = sorted(set(data) - set(accepted))
    if unknown:
        section = f"[{prefix.rstrip('.')}]" if prefix else "the top level"
        raise ConfigError(f"unknown config key {prefix + unknown[0]!r}{where}; valid keys in {section}: "
                          f"{', '.join(accepted)}")
    for name, inner in accepted.items():
        if inner is None or name not in data:
            continue
        table = data[name]
        if not isinstance(table, Mapping):
            raise ConfigError(f"config key {prefix + name!r}{where}: expected a table, got {table!r}")
        bad = sorted(set(table) - set(inner))
        if bad:
            raise ConfigError(f"unknown config key '{prefix}{name}.{bad[0]}'{where}; valid keys in "
                              f"[{prefix}{name}]: {', '.join(inner)}")


def _unalias(cls: type, data: Mapping[str, Any], deep: bool = True) -> dict[str, Any]:
    """`data` with every alias key renamed to its field's name (in `section` tables and,
    with `deep`, nested dataclass tables too); an alias given beside its name is an error."""
    if not isinstance(data, Mapping):
        return data  # type: ignore[return-value]
    out = dict(data)
    hints = typing.get_type_hints(cls)
    for f in _init_fields(cls):
        if f.metadata.get(FLAT):
            out = _unalias(hints[f.name], out, deep)
            continue
        section = f.metadata.get(SECTION)
        if f.metadata.get(MOVED) and f.name in out and isinstance(out.get(section, {}), Mapping):
            out[section] = dict(out.get(section, {}))
            _move_in(out, out[section], f.name, section)
        table = dict(out.get(section, {})) if section and isinstance(out.get(section), Mapping) else out
        for alias in f.metadata.get(ALIASES, ()):
            if alias in table:
                if f.name in table:
                    raise ConfigError(f"config keys {alias!r} and {f.name!r} name one setting; give one")
                table[f.name] = table.pop(alias)
        if deep and dataclasses.is_dataclass(hints[f.name]) and isinstance(table.get(f.name), Mapping):
            table[f.name] = _unalias(hints[f.name], table[f.name])
        if section and section in out:
            out[section] = table
    return out


def _move_in(out: dict[str, Any], table: dict[str, Any], name: str, section: str) -> None:
    """A moved key given at its old level too: into its section's table (what the command
    line gave wins over the file; the same key twice in files is an error)."""
    old = out.pop(name)
    if name in table and not _is_cli(old):
        if _is_cli(table[name]):
            return
        raise ConfigError(f"config keys {name!r} and '{section}.{name}' name one setting ({name!r} is its older "
                          "place); give one")
    table[name] = old


def _no_default(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _fail(key: str, where: str, annotation: Any, value: Any) -> ConfigError:
    return ConfigError(
        f"config key {key!r}{where}: expected {_type_name(annotation)}, got {type(value).__name__} {str(value)!r}"
    )


_DICTS = (dict, Mapping, collections.abc.Mapping)
_LISTS = (list, tuple, Sequence, collections.abc.Sequence)


def _coerce(value: Any, annotation: Any, key: str, where: str) -> Any:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if isinstance(value, _OnTop):
        return _coerce_on_top(value, annotation, origin, key, where)
    if dataclasses.is_dataclass(annotation):
        return from_dict(annotation, value, where, prefix=key + ".")
    if origin in (typing.Union, pytypes.UnionType):
        return _coerce_union(value, args, annotation, key, where)
    if origin is typing.Literal:
        for choice in args:
            if value == choice or (isinstance(value, _CliValue) and str(choice) == value):
                return choice
        raise ConfigError(f"config key {key!r}{where}: expected one of {list(args)}, got {value!r}")
    if origin in _DICTS or origin in _LISTS:
        return _coerce_container(value, annotation, origin, args, key, where)
    if annotation is Any:
        return _any_value(value)
    if isinstance(value, _CliRepeat):  # a scalar flag given twice: the last one wins
        value = value[-1]
    return _coerce_scalar(value, annotation, key, where)


def _coerce_on_top(value: _OnTop, annotation: Any, origin: Any, key: str, where: str) -> Any:
    """The file's list or table plus what the command line adds; any other value: the command line's."""
    cli = value.cli
    if origin in _DICTS and not _is_literal(cli):
        return {**_coerce(value.base, annotation, key, where), **_coerce(cli, annotation, key, where)}
    if origin in _LISTS and not _is_literal(cli):
        base, more = _coerce(value.base, annotation, key, where), _coerce(cli, annotation, key, where)
        return type(base)([*base, *more])
    return _coerce(cli, annotation, key, where)


def _is_literal(value: Any) -> bool:
    return isinstance(value, _CliValue) and value.lstrip()[:1] in ("[", "{")


def _any_value(value: Any) -> Any:
    """A value of an untyped (Any) field: a command-line value is read as a TOML literal
    where it is one (`8`, `true`, `"x"`), else kept as the string."""
    if isinstance(value, _CliRepeat):
        value = value[-1]
    if isinstance(value, _CliValue):
        try:
            return tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            return str(value)
    return value


def _coerce_union(value: Any, args: tuple, annotation: Any, key: str, where: str) -> Any:
    if type(None) in args and (value is None or (isinstance(value, _CliValue) and value.lower() in ("none", "null"))):
        return None
    for arg in (a for a in args if a is not type(None)):
        try:
            return _coerce(value, arg, key, where)
        except ConfigError:
            continue
    raise _fail(key, where, annotation, value)


def _coerce_container(value: Any, annotation: Any, origin: Any, args: tuple, key: str, where: str) -> Any:
    is_dict = origin in _DICTS
    if isinstance(value, (_CliValue, _CliRepeat)):
        value = _cli_container(value, is_dict, key)
    if is_dict:
        if not isinstance(value, Mapping):
            raise _fail(key, where, annotation, value)
        value_tp = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(v, value_tp, f"{key}.{k}", where) for k, v in value.items()}
    if not isinstance(value, (list, tuple)):
        raise _fail(key, where, annotation, value)
    item_tp = args[0] if args else Any
    items = [_coerce(v, item_tp, f"{key}[{i}]", where) for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


def _cli_container(value: Any, is_dict: bool, key: str) -> Any:
    """Command-line values of a list or dict field: `[...]` / `{...}` literals, or items
    (`X` of a list, `NAME=VALUE` of a dict), each flag given adding to the ones before."""
    out: Any = {} if is_dict else []
    for text in value if isinstance(value, _CliRepeat) else [value]:
        if _is_literal(text):
            parsed = _parse_toml_literal(text, key)
            out = {**out, **parsed} if is_dict and isinstance(parsed, Mapping) else \
                ([*out, *parsed] if not is_dict and isinstance(parsed, list) else parsed)
        elif is_dict:
            name, sep, item = text.partition("=")
            if not sep or not name:
                raise ConfigError(f"config key {key!r}: expected NAME=VALUE, got {str(text)!r}")
            out[name] = _CliValue(item)
        else:
            out.append(_CliValue(text))
    return out


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
        if isinstance(value, (str, Path)):
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


@dataclasses.dataclass(frozen=True)
class Setting:
    """One settable key of a config dataclass (for flags, `--help` and documentation)."""

    key: str                     # dotted, as written in TOML and flags: "port", "engine.seed", "parallel.tp"
    annotation: Any
    default: Any                 # dataclasses.MISSING when required
    doc: str                     # from the owning class docstring's `name: text` entry
    aliases: tuple[str, ...]     # older dotted keys for the same setting
    owner: type                  # the dataclass that declares the field
    limit: bool = False          # marked `meta(limit=True)`: a bound on requests

    @property
    def section(self) -> str:
        return self.key.rpartition(".")[0]

    @property
    def repeatable(self) -> bool:
        annotation = _without_none(self.annotation)
        return typing.get_origin(annotation) in _DICTS or typing.get_origin(annotation) in _LISTS

    @property
    def is_dict(self) -> bool:
        return typing.get_origin(_without_none(self.annotation)) in _DICTS

    def default_text(self) -> str:
        if self.default is dataclasses.MISSING:
            return "required"
        return repr(dict(self.default) if isinstance(self.default, Mapping) else self.default)


def _without_none(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, pytypes.UnionType):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def settings(cls: type, prefix: str = "") -> list[Setting]:
    """Every settable key of `cls`, nested sections expanded, in declaration order."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out: list[Setting] = []
    for f in _init_fields(cls):
        annotation = hints[f.name]
        if f.metadata.get(FLAT):
            out.extend(settings(annotation, prefix))
            continue
        if dataclasses.is_dataclass(annotation):
            out.extend(settings(annotation, f"{prefix}{f.name}."))
            continue
        section = f"{prefix}{f.metadata[SECTION]}." if f.metadata.get(SECTION) else prefix
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        old = (prefix + f.name,) if f.metadata.get(MOVED) else ()
        out.append(Setting(section + f.name, annotation, default, docs.get(f.name, ""),
                           old + tuple(section + a for a in f.metadata.get(ALIASES, ())), cls,
                           bool(f.metadata.get(LIMIT))))
    return out


_DOC_ENTRY = re.compile(r"^(\w+(?:\s*/\s*\w+)*):\s+(.*)$")


def field_docs(cls: type) -> dict[str, str]:
    """`name: text` entries of a dataclass docstring (`a / b: text` documents both), with
    their indented continuation lines: the one place a setting is documented."""
    docs: dict[str, str] = {}
    names: list[str] = []
    fields = {f.name for f in dataclasses.fields(cls)}
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        m = _DOC_ENTRY.match(line)
        if m and set(n.strip() for n in m[1].split("/")) <= fields:
            names = [n.strip() for n in m[1].split("/")]
            for name in names:
                docs[name] = m[2].strip()
        elif names and line.startswith(" ") and line.strip():
            for name in names:
                docs[name] += " " + line.strip()
        else:
            names = []
    return docs


def flag_names(s: Setting) -> list[str]:
    """`--data-dir` for a top-level key (dashes, as Unix flags), `--engine.seed` for a
    section's; aliases (older names) first."""
    return [f"--{k}" if "." in k else f"--{k.replace('_', '-')}" for k in (*s.aliases, s.key)]


def add_arguments(parser: argparse.ArgumentParser, cls: type, titles: Mapping[str, str] | None = None) -> None:
    """One flag per setting of `cls` (default None: unset flags leave the file's or the
    dataclass's value), grouped per section with the section's class docstring."""
    groups: dict[str, Any] = {}
    for s in settings(cls):
        if s.section not in groups:
            title = (titles or {}).get(s.section) or (f"[{s.section}]" if s.section else "server")
            summary = (s.owner.__doc__ or "").strip().splitlines()[0] if s.section else None
            groups[s.section] = parser.add_argument_group(title, summary)
        doc = f"{s.doc} " if s.doc else ""
        kwargs: dict[str, Any] = {"dest": s.key, "default": None, "metavar": _metavar(s),
                                  "help": f"{doc}(default: {s.default_text()})".replace("%", "%%")}
        if s.repeatable:
            kwargs["action"] = "append"
            if s.is_dict:
                kwargs["type"] = _name_value
        groups[s.section].add_argument(*flag_names(s), **kwargs)


def _name_value(text: str) -> str:
    if text.lstrip()[:1] == "{" or text.partition("=")[0] and "=" in text:
        return text
    raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")


def _metavar(s: Setting) -> str:
    if s.is_dict:
        return "NAME=VALUE"
    annotation = _without_none(s.annotation)
    if s.repeatable:
        annotation = (typing.get_args(annotation) or (str,))[0]
    if typing.get_origin(annotation) in (typing.Union, pytypes.UnionType):
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is typing.Literal:
        return _key_type(annotation)
    return _key_type(annotation).upper().replace(" ", "")


def overrides_from_args(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """{dotted key: command-line value} of the flags `add_arguments` made that were given."""
    out: dict[str, Any] = {}
    for s in settings(cls):
        value = getattr(args, s.key, None)
        if value is None:
            continue
        out[s.key] = _CliRepeat(_CliValue(v) for v in value) if isinstance(value, list) else _CliValue(value)
    return out


def describe_keys(cls: type, prefix: str = "") -> list[str]:
    """One line per settable key of `cls`: `--dotted.key TYPE (default: VALUE)`, nested
    sections expanded, for `--help` texts that stay true as the dataclasses change."""
    return [f"--{prefix}{s.key} {_key_type(s.annotation)} ({'required' if s.default is dataclasses.MISSING else 'default: ' + repr(s.default)})"
            for s in settings(cls)]


def _key_type(annotation: Any) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(annotation)) + "}"
    return _type_name(annotation)
