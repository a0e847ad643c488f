"""`ember hub-link ID DIR`: make a local model directory answer to a Hugging Face hub id.

Code written for the hub (tinker-cookbook's recipes, `AutoTokenizer.from_pretrained(
"Qwen/Qwen3.5-9B-Base")`) names a model by its hub id and loads its tokenizer and config
from the hub, or from the local Hugging Face cache when the hub cannot be reached or
`HF_HUB_OFFLINE=1` is set. This command writes DIR into that cache under ID, in the
cache's own layout (`models--ORG--NAME/refs/main` naming a snapshot, `snapshots/<rev>/`
holding one symbolic link per file of DIR), so those lookups resolve to DIR without
network and without copying it; `ember serve --model ID=DIR` serves the same directory
under the same name. Nothing in DIR is written.

The snapshot's revision is derived from DIR's absolute path, so linking the same
directory again is a no-op and linking another one replaces the link. A cache entry that
holds real downloaded files is never replaced.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import sys
from pathlib import Path

# "org/name" as the hub spells repository ids; no path tricks (`..`, slashes, a leading dot).
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")


class HubLinkError(ValueError):
    """An id, a directory or a cache entry this command will not link (the message says which)."""


def check_repo_id(repo_id: str) -> str:
    if not _REPO_ID.match(repo_id) or ".." in repo_id:
        raise HubLinkError(f"hub id must look like ORG/NAME (letters, digits, '_', '.', '-'), got {repo_id!r}")
    return repo_id


def check_model_dir(model_dir: str | os.PathLike) -> Path:
    path = Path(model_dir).expanduser().resolve()
    if not path.is_dir():
        raise HubLinkError(f"model directory {str(model_dir)!r} does not exist or is not a directory")
    if not (path / "config.json").is_file():
        raise HubLinkError(f"model directory {str(path)!r} has no config.json: not a Hugging Face model directory")
    return path


def default_cache_dir() -> Path:
    """The hub cache transformers reads (`HF_HUB_CACHE`, else `HF_HOME/hub`, else ~/.cache)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def revision_of(model_dir: Path) -> str:
    """A 40-hex revision (the shape of a git commit, which the cache expects) naming DIR."""
    return hashlib.sha1(str(model_dir).encode()).hexdigest()


def _is_ours(snapshot: Path) -> bool:
    """A snapshot made of links that point outside the cache's blobs (what this command writes)."""
    files = [p for p in snapshot.rglob("*") if not p.is_dir() or p.is_symlink()]
    return all(p.is_symlink() and "blobs" not in Path(os.readlink(p)).parts for p in files)


def _check_replaceable(repo: Path) -> None:
    snapshots = repo / "snapshots"
    for snap in snapshots.iterdir() if snapshots.is_dir() else ():
        if not _is_ours(snap):
            raise HubLinkError(f"{str(repo)!r} holds files downloaded from the hub (snapshot {snap.name}); "
                               "refusing to replace them: remove that cache entry first or pass --cache-dir")


def link_into_cache(repo_id: str, model_dir: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """Write `model_dir` into the hub cache under `repo_id`; return the snapshot directory."""
    repo_id = check_repo_id(repo_id)
    source = check_model_dir(model_dir)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    if repo.exists():
        _check_replaceable(repo)
        shutil.rmtree(repo)
    revision = revision_of(source)
    snapshot = repo / "snapshots" / revision
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        rel = file.relative_to(source)
        if any(part.startswith(".") for part in rel.parts):
            continue  # .git, .cache: not model files
        (snapshot / rel).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / rel).symlink_to(file)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("repo_id", help="the hub id code will ask for, e.g. Qwen/Qwen3.5-9B-Base")
    parser.add_argument("model_dir", help="the local model directory (config.json, weights, tokenizer files)")
    parser.add_argument("--cache-dir", default=None,
                        help="the hub cache to write (default: $HF_HUB_CACHE, else $HF_HOME/hub, else "
                             "~/.cache/huggingface/hub: where transformers looks)")


def run(args: argparse.Namespace) -> int:
    try:
        snapshot = link_into_cache(args.repo_id, args.model_dir, args.cache_dir)
    except HubLinkError as e:
        print(f"ember hub-link: {e}", file=sys.stderr)
        return 2
    print(f"{args.repo_id} -> {Path(args.model_dir).resolve()} (linked in {snapshot}); "
          f"serve it with: ember serve --model {args.repo_id}={args.model_dir}; "
          "set HF_HUB_OFFLINE=1 so lookups do not try the hub first")
    return 0
