"""Snapshot sampling sessions of a run's older weights, kept across a restart (README "Restarts").

A snapshot session (`save_weights_and_get_sampling_client`) taken before the run's last
optim_step holds weights the run no longer has. When the sampler can hand a version's
tensors back (`Sampler.version_weights`), each such version is written once per automatic
save as a subfolder `older-<weights token>/` of the run's sampler save `ember-autosave`
(`SamplerManager.persist_snapshots`), in the layout any sampler save has (peft adapter or
model safetensors: `checkpoint_files.read_sampler_weights` reads it back). A folder the
previous save already holds is linked, not written again; a folder no live session
references is not carried over, so it goes with the replaced save.

The record naming the folders (`ember-snapshots.json`) is read back from disk after a
restart: every folder it names is checked (`older_dir`) to be one of these subfolders of
the run's save, never a path elsewhere.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from ember.models import LORA_ALPHA
from ember.models.adapter import write_peft_adapter

OLDER_PREFIX = "older-"
_FOLDER = re.compile(r"older-[0-9a-f]{1,64}")
FULL_WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class OlderEntry:
    """An older snapshot session's entry in the record: its folder and the weights token."""

    folder: str
    weights: str


@dataclass(frozen=True)
class OlderVersion:
    """One older version to keep: its token, its tensors (None: the backend cannot give
    them), its LoRA rank (None: full weights) and the base model's name for the adapter config."""

    weights: str
    tensors: Callable[[], Mapping[str, torch.Tensor] | None]
    lora_rank: int | None
    base_model: str


def older_folder(weights_token: str) -> str:
    """The subfolder that holds the weights named `weights_token` (a uuid hex)."""
    folder = OLDER_PREFIX + weights_token
    if _FOLDER.fullmatch(folder) is None:
        raise ValueError(f"weights token {weights_token!r} is not hexadecimal")
    return folder


def older_dir(save_dir: Path, folder: object) -> Path:
    """`save_dir`/`folder`, where `folder` was read from the record on disk: a ValueError
    naming it unless it is one `older-<hex>` subfolder directly inside `save_dir`."""
    if not isinstance(folder, str) or _FOLDER.fullmatch(folder) is None:
        raise ValueError(f"folder {folder!r} is not an 'older-<hex>' subfolder name")
    root = save_dir.resolve()
    path = (root / folder).resolve()
    if path.parent != root or not path.is_dir():
        raise ValueError(f"folder {folder!r} is not a subfolder of {str(root)!r}")
    return path


def parse_older(raw: object) -> dict[str, OlderEntry]:
    """The record's `older_sessions` ({session id: {folder, weights}}); a TypeError when
    malformed. Folders are checked where they are used (`older_dir`)."""
    if not isinstance(raw, dict):
        raise TypeError("older_sessions is not an object")
    out: dict[str, OlderEntry] = {}
    for sid, entry in raw.items():
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str) for k in ("folder", "weights")):
            raise TypeError(f"older_sessions[{sid!r}] is not {{folder, weights}}")
        out[sid] = OlderEntry(entry["folder"], entry["weights"])
    return out


def write_older(tmp: Path, previous: Path | None, version: OlderVersion) -> str | None:
    """Write `version` as its subfolder of the new save `tmp`, linked from the `previous`
    save when that holds it already; its folder name, or None when the backend cannot give
    the tensors back (its sessions keep the behaviour of a lost snapshot)."""
    folder = older_folder(version.weights)
    out = tmp / folder
    if previous is not None and (previous / folder).is_dir():
        shutil.copytree(previous / folder, out, copy_function=_link_or_copy)
        return folder
    tensors = version.tensors()
    if tensors is None:
        return None
    if version.lora_rank is None:
        out.mkdir(parents=True)
        on_cpu = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
        safetensors.torch.save_file(on_cpu, str(out / FULL_WEIGHTS), metadata={"format": "pt"})
    else:
        write_peft_adapter(out, tensors, rank=version.lora_rank, alpha=LORA_ALPHA, base_model=version.base_model)
    return folder


def _link_or_copy(src: str, dst: str) -> None:
    """Files of a save are never rewritten in place: a hard link shares them safely."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
