"""Checkpoint names, `tinker://` paths and the on-disk layout under the data directory.

    tinker://<run_id>/weights/<name>          -> <data_dir>/checkpoints/<run_dir>/weights/<name>/
        `engine.save_state` (DCP shards of the trainable tensors + Adam state + step)
    tinker://<run_id>/sampler_weights/<name>  -> <data_dir>/checkpoints/<run_dir>/sampler_weights/<name>/
        `engine.export_hf` (peft adapter safetensors for LoRA; HF safetensors for full FT)
    tinker://<run_id>/external_weights/<name> -> <data_dir>/checkpoints/<run_dir>/external_weights/<name>/
        `ember.service.external.write_export` (Hugging Face format with tokenizer files)

`<run_dir>` is the run id with every character outside [A-Za-z0-9_.-] replaced by "_"
(run ids contain ':'); the database maps each tinker path to its directory, so the
directory name never has to be parsed back.

Crash consistency: the checkpoint row is the commit point. Each save writes a fresh
directory `<name>.<hex8>` (built as `.<name>.<hex8>.tmp`, fsync'd, renamed when complete),
then upserts the row pointing at it, then removes the directory the row named before (an
overwrite). A kill at any point leaves every row naming a complete directory; whatever no
row names is garbage that `ember.service.sweep` removes at start-up. Rows written before
this layout name `<name>` itself, which keeps working: readers only ever use the row's
`directory`.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from ember.service.api import UserError

log = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")  # fullmatch: `$` would let a final "\n" through
KIND_SEGMENTS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
SEGMENT_OF_KIND = {v: k for k, v in KIND_SEGMENTS.items()}


def validate_name(name: object) -> str:
    """A checkpoint name must stay inside its directory: no '/', '..', absolute paths or
    odd characters (letters, digits, '_', '.', '-'; at most 128; not starting with '.' or '-')."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise UserError(
            f"invalid checkpoint name {name!r}: use 1-128 characters from [A-Za-z0-9_.-], "
            "starting with a letter, digit or '_', without '..' or '/'"
        )
    return name


@dataclass(frozen=True)
class TinkerPath:
    run_id: str
    kind: str  # "training" | "sampler" | "external"
    name: str

    @property
    def uri(self) -> str:
        return f"tinker://{self.run_id}/{SEGMENT_OF_KIND[self.kind]}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        """As in REST paths: "weights/<name>" / "sampler_weights/<name>" / "external_weights/<name>"."""
        return f"{SEGMENT_OF_KIND[self.kind]}/{self.name}"


def parse_tinker_path(path: object) -> TinkerPath:
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise UserError(f"expected a tinker:// checkpoint path, got {path!r}")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or not parts[0] or parts[1] not in KIND_SEGMENTS:
        raise UserError(
            f"invalid checkpoint path {path!r}: expected tinker://<run_id>/weights/<name>, "
            "tinker://<run_id>/sampler_weights/<name> or tinker://<run_id>/external_weights/<name>"
        )
    return TinkerPath(parts[0], KIND_SEGMENTS[parts[1]], validate_name(parts[2]))


def run_dir_name(run_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", run_id)


def checkpoint_dir(data_dir: Path, tpath: TinkerPath) -> Path:
    root = (data_dir / "checkpoints").resolve()
    d = (root / run_dir_name(tpath.run_id) / SEGMENT_OF_KIND[tpath.kind] / tpath.name).resolve()
    if root not in d.parents:  # defence in depth; validate_name already forbids escapes
        raise UserError(f"checkpoint path {tpath.uri!r} escapes the data directory")
    return d


def new_version_dir(data_dir: Path, tpath: TinkerPath) -> Path:
    """A fresh directory for one save of `tpath`, next to where `<name>` lives; not yet created."""
    base = checkpoint_dir(data_dir, tpath)
    while True:
        d = base.with_name(f"{base.name}.{uuid.uuid4().hex[:8]}")
        if not d.exists() and not temp_dir_of(d).exists():  # a 2^-32 clash with a name like "ck.0a1b2c3d"
            return d


def temp_dir_of(final: Path) -> Path:
    """Where a save builds `final` (a leading '.' no checkpoint name has: never listed, swept)."""
    return final.with_name(f".{final.name}.tmp")


def fsync_tree(path: Path) -> None:
    """Flush every file and directory under `path` (and `path`) to disk: a rename that
    follows must not publish a directory whose contents a power cut could still lose."""
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(d))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Make the complete, flushed `tmp` appear as `final` (atomic rename, parent flushed)."""
    fsync_tree(tmp)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def remove_checkpoint_dir(data_dir: Path, directory: str | Path) -> None:
    """Remove a checkpoint's directory, as its row names it; never anything outside
    `<data_dir>/checkpoints/` (a row written under another data directory is left alone)."""
    root = (data_dir / "checkpoints").resolve()
    d = Path(directory).resolve()
    if root not in d.parents or len(d.relative_to(root).parts) != 3:  # <run_dir>/<segment>/<entry>
        log.warning("not removing checkpoint directory %s: it is not a checkpoint under %s", d, root)
        return
    remove_dir(d)


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def remove_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------- reading weights
def read_state_weights(path: Path) -> dict[str, torch.Tensor]:
    """The trained tensors of a `save_state` directory, without building an engine.

    Keys are the engine's adapter-independent names: for LoRA these equal PEFT's
    saved-adapter names (`...q_proj.lora_A.weight`), for full FT the HF parameter names.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(path)).read_metadata()
    state: dict[str, torch.Tensor] = {}
    for fqn, md in meta.state_dict_metadata.items():
        if fqn.startswith("model.") and isinstance(md, TensorStorageMetadata):
            state[fqn[len("model.") :]] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp.load({"model": state}, checkpoint_id=str(path))
    return state


def read_sampler_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of an `export_hf` directory (peft adapter or HF model safetensors)."""
    import safetensors.torch

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"sampler checkpoint directory {str(path)!r} holds no safetensors")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(safetensors.torch.load_file(str(f)))
    return out
