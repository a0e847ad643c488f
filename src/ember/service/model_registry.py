"""The base models a service serves: `ModelRegistry` (name -> local directory, and which
unregistered directories may be named by path) and `BaseModel`."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ember.service.api import UserError


@dataclass(frozen=True)
class BaseModel:
    """A base model as the user names it, and the local directory it is loaded from."""

    name: str
    directory: Path


def is_model_dir(directory: Path) -> bool:
    try:
        return (directory / "config.json").is_file()
    except OSError:  # a name too long, a component that is not a directory, ...
        return False


def real_path(path: str | Path) -> Path:
    """The path with every symlink and `..` resolved (what would actually be opened)."""
    return Path(os.path.realpath(Path(path).expanduser()))


class ModelRegistry:
    """name → local directory, and which unregistered directories may be named by path.

    A base model is a registered name, or the path of a model directory whose real
    location (symlinks and `..` resolved) lies under one of `roots` (`--model-root`, none
    by default) and not under any of `private` (the data directory: other tenants'
    checkpoints and exports live there). Anything else gets the same "unknown base model"
    error, so the answer never tells whether a path exists.

    A registered model may also be named by the directory it was registered with
    (`--model tiny=./tiny-model`: `./tiny-model`, `tiny-model` or its absolute path): code
    that loads the tokenizer client-side from `model_name` (tinker-cookbook's recipes) then
    finds it on disk instead of asking the Hugging Face hub. The comparison is on strings
    (normalised), so a tenant's name never makes the server look at the filesystem.
    """

    def __init__(self, models: Mapping[str, str], roots: Sequence[str | Path] = (),
                 private: Sequence[str | Path] = ()) -> None:
        self._models: dict[str, Path] = {}
        self._by_directory: dict[str, str] = {}  # a spelling of a registered directory -> its name
        self._roots = [real_path(r) for r in roots]
        self._private = [real_path(p) for p in private]
        self._seen: dict[Path, dict[str, tuple[int, int]]] = {}  # directory -> its files when first resolved
        self.add_all(models)

    def resolve(self, name: str) -> BaseModel:
        if not isinstance(name, str) or not name:
            raise UserError(f"base_model must be a non-empty string, got {name!r}")
        if name in self._models:
            return self._unchanged(BaseModel(name, self._models[name]))
        registered = self._by_directory.get(os.path.normpath(name)) if "\x00" not in name else None
        if registered is not None:
            return self._unchanged(BaseModel(registered, self._models[registered]))
        directory = self._allowed_directory(name)
        if directory is not None:
            return self._unchanged(BaseModel(name, directory))
        known = ", ".join(sorted(self._models)) or "none registered"
        where = (f", or the path of a model directory under a model root ({', '.join(map(str, self._roots))})"
                 if self._roots else "; naming a directory by path needs the operator's --model-root")
        raise UserError(f"unknown base model {name!r}: the registered names are {known}{where}")

    def _unchanged(self, base: BaseModel) -> BaseModel:
        """`base`, unless its files changed since it was first resolved.

        Loaded models (the shared LoRA base, the sampler backends) are cached per directory
        for the life of the process; a directory rewritten under a running server would
        otherwise be trained on or sampled from stale (or, with a new tokenizer, refuse
        valid token ids). Refused instead, naming the files, until a restart."""
        now = model_files(base.directory)
        before = self._seen.setdefault(base.directory, now)
        if now != before:
            changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
            raise UserError(
                f"base model {base.name!r}: the files of {base.directory} changed since this process loaded them "
                f"({', '.join(changed[:5])}); it keeps the loaded copy, so restart `ember serve` (or the "
                f"in-process ServiceClient) to use the new files")
        return base

    def _allowed_directory(self, name: str) -> Path | None:
        if not self._roots or "\x00" in name:
            return None
        try:
            p = real_path(name)
        except (OSError, ValueError):
            return None
        if any(p.is_relative_to(d) for d in self._private):
            return None
        if not any(p.is_relative_to(r) for r in self._roots):
            return None
        return p if is_model_dir(p) else None

    def add_all(self, models: Mapping[str, str]) -> None:
        """Register more names (a name already registered keeps its directory unless equal)."""
        for name, d in models.items():
            p = Path(d).expanduser()
            if name in self._models and self._models[name].resolve() != p.resolve():
                raise ValueError(f"base model {name!r} is already registered as {self._models[name]}, not {p}")
            self._models[name] = p
            for spelling in {os.path.normpath(str(p)), os.path.abspath(p), str(real_path(p))}:
                self._by_directory.setdefault(spelling, name)  # the first name registered for a directory

    def names(self) -> list[str]:
        return sorted(self._models)


MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".model", ".txt", ".tiktoken")  # config, weights, tokenizer


def model_files(directory: Path) -> dict[str, tuple[int, int]]:
    """name -> (size, mtime_ns) of the files a model is loaded from (top level of its directory)."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return {}
    out = {}
    for entry in entries:
        if entry.name.endswith(MODEL_FILE_SUFFIXES) and entry.is_file():
            st = entry.stat()
            out[entry.name] = (st.st_size, st.st_mtime_ns)
    return out
