"""What a killed server left in its data directory, removed at start-up.

A save killed before its row was committed leaves `.<name>.<hex8>.tmp` (older versions:
`.<name>.tmp-<hex8>`) or a complete `<name>.<hex8>` that no row names; one killed after
committing an overwrite leaves the directory it replaced (see `ember.service.checkpoint_files`).
Samplers of the killed lifetime leave `scratch/sampler-<hex8>` (`LocalSamplerFactory`).

`sweep_data_dir` runs once, under the data-directory lock, after the database is open and
before any run or sampler of this lifetime exists: nothing it removes can be in use.
It is conservative: it removes only directories of the shapes ember creates, only at
`checkpoints/<run_dir>/<segment>/<entry>` and `scratch/<entry>`, and never follows a
symbolic link; anything else is logged and kept.
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

from ember.service.checkpoint_files import SEGMENT_OF_KIND

log = logging.getLogger(__name__)

SCRATCH = "scratch"  # <data_dir>/scratch: Service passes it to LocalSamplerFactory
_ENTRY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")  # <name> (old layout) or <name>.<hex8>
_TEMP = re.compile(r"\.[A-Za-z0-9_][A-Za-z0-9_.\-]*\.tmp(-[0-9a-f]{8})?")
_SAMPLER = re.compile(r"sampler-[0-9a-f]{8}")


def sweep_data_dir(data_dir: Path, referenced: Iterable[str]) -> list[Path]:
    """Remove unreferenced checkpoint directories and previous lifetimes' sampler scratch;
    `referenced` is every checkpoint row's `directory`. Returns what was removed."""
    removed = sweep_checkpoints(data_dir, referenced) + sweep_scratch(data_dir / SCRATCH)
    if removed:
        log.warning("start-up: removed %d directory(ies) left by an interrupted lifetime: %s",
                    len(removed), ", ".join(str(p) for p in removed))
    return removed


def _key(path: str | Path) -> tuple[str, ...]:
    """A checkpoint directory is `.../checkpoints/<run_dir>/<segment>/<entry>`; rows hold
    absolute paths, so matching the last three parts keeps every checkpoint of a data
    directory that was moved since its rows were written."""
    return Path(path).parts[-3:]


def sweep_checkpoints(data_dir: Path, referenced: Iterable[str]) -> list[Path]:
    keep = {_key(d) for d in referenced}
    removed: list[Path] = []
    for run_dir in _plain_dirs(data_dir / "checkpoints"):
        for segment in _plain_dirs(run_dir):
            if segment.name not in SEGMENT_OF_KIND.values():
                log.warning("start-up sweep: keeping unexpected %s", segment)
                continue
            for entry in _entries(segment):
                if _key(entry) in keep:
                    continue
                if _is_plain_dir(entry) and (_ENTRY.fullmatch(entry.name) or _TEMP.fullmatch(entry.name)):
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(entry)
                else:
                    log.warning("start-up sweep: keeping unexpected %s", entry)
    return removed


def sweep_scratch(scratch: Path) -> list[Path]:
    removed: list[Path] = []
    for entry in _entries(scratch):
        if _is_plain_dir(entry) and _SAMPLER.fullmatch(entry.name):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        else:
            log.warning("start-up sweep: keeping unexpected %s", entry)
    return removed


def _is_plain_dir(path: Path) -> bool:
    return not path.is_symlink() and path.is_dir()


def _entries(path: Path) -> list[Path]:
    if not _is_plain_dir(path):
        return []
    try:
        return sorted(path.iterdir())
    except OSError as exc:
        log.warning("start-up sweep: cannot list %s: %s", path, exc)
        return []


def _plain_dirs(path: Path) -> list[Path]:
    out = []
    for entry in _entries(path):
        if _is_plain_dir(entry):
            out.append(entry)
        else:
            log.warning("start-up sweep: keeping unexpected %s", entry)
    return out
