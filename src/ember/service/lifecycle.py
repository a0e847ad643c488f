"""Who may use a checkpoint, and for how long: the one visibility check of every
`tinker://` path, publishing, TTLs and the bounds of a save's `user_metadata`.

Every call that reads a checkpoint by path (a sampling session from `model_path`, a
training run from its state, `load_state`, weights info, the OpenAI routes' `model=
tinker://...`) goes through `readable`: the owner, or anyone while it is published. Every
call that changes one (publish, unpublish, TTL, delete) goes through `owned`. A checkpoint
past its expiry is gone for both from that instant on, before the sweep deletes its
files. Each refusal answers the same `NotFoundError` as a path never saved, so a caller
learns nothing about checkpoints it may not see.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from ember.service import checkpoints as ckpt
from ember.service.api import NotFoundError, UserError
from ember.service.config import CheckpointConfig
from ember.service.store import CheckpointRow, Store

READ_REFUSED = "checkpoint {path!r} not found (or not visible to this API key)"
WRITE_REFUSED = "checkpoint {path!r} not found (or not owned by this API key)"


def expired(row: CheckpointRow, now: float | None = None) -> bool:
    return row.expires_at is not None and row.expires_at <= (time.time() if now is None else now)


def _live_row(store: Store, path: object) -> tuple[ckpt.TinkerPath, CheckpointRow | None]:
    tpath = ckpt.parse_tinker_path(path)
    row = store.get(CheckpointRow, tpath.uri)
    return tpath, None if row is None or expired(row) else row


def readable(store: Store, owner: str, path: object) -> tuple[ckpt.TinkerPath, CheckpointRow]:
    """The checkpoint at `path` if `owner` may read it (owns it, or it is published)."""
    tpath, row = _live_row(store, path)
    if row is None or not (row.owner == owner or row.public):
        raise NotFoundError(READ_REFUSED.format(path=path))
    return tpath, row


def owned(store: Store, owner: str, path: object) -> tuple[ckpt.TinkerPath, CheckpointRow]:
    """The checkpoint at `path` if `owner` owns it (publish, unpublish, TTL, delete)."""
    tpath, row = _live_row(store, path)
    if row is None or row.owner != owner:
        raise NotFoundError(WRITE_REFUSED.format(path=path))
    return tpath, row


def rest_path(run_id: object, checkpoint_id: object) -> str:
    """`tinker://<run_id>/<checkpoint_id>` from REST path parameters, checked."""
    if not isinstance(run_id, str) or not run_id or "/" in run_id:
        raise UserError(f"run_id must be a training run id without '/', got {run_id!r}")
    if not isinstance(checkpoint_id, str) or checkpoint_id.count("/") != 1:
        raise UserError("checkpoint_id must look like 'weights/<name>', 'sampler_weights/<name>' or "
                        f"'external_weights/<name>', got {checkpoint_id!r}")
    return f"tinker://{run_id}/{checkpoint_id}"


def check_ttl(ttl_seconds: Any, config: CheckpointConfig) -> int | None:
    """`ttl_seconds` of a save or a TTL change: None (never expires) or 1..max_ttl_s."""
    if ttl_seconds is None:
        return None
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int):
        raise UserError(f"ttl_seconds must be an integer number of seconds or null, got "
                        f"{type(ttl_seconds).__name__} {ttl_seconds!r}")
    if not 1 <= ttl_seconds <= config.max_ttl_s:
        raise UserError(f"ttl_seconds must be between 1 and {config.max_ttl_s} (checkpoints.max_ttl_s), "
                        f"or null for no expiry; got {ttl_seconds}")
    return ttl_seconds


def check_metadata(meta: Any, config: CheckpointConfig) -> dict[str, str] | None:
    """A save's `user_metadata`: string keys and values, within the configured bounds."""
    if meta is None:
        return None
    if not isinstance(meta, Mapping):
        raise UserError(f"user_metadata must be an object of strings, got {type(meta).__name__}")
    if len(meta) > config.max_metadata_entries:
        raise UserError(f"user_metadata has {len(meta)} entries; the limit is "
                        f"{config.max_metadata_entries} (checkpoints.max_metadata_entries)")
    for key, value in meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise UserError(f"user_metadata[{_short(str(key))}]: keys and values must be strings, got "
                            f"{type(key).__name__} -> {type(value).__name__}")
        if not 1 <= len(key) <= config.max_metadata_key_chars:
            raise UserError(f"user_metadata key {_short(key)} has {len(key)} characters; expected 1 to "
                            f"{config.max_metadata_key_chars} (checkpoints.max_metadata_key_chars)")
        if len(value) > config.max_metadata_value_chars:
            raise UserError(f"user_metadata[{_short(key)}] has {len(value)} characters; the limit is "
                            f"{config.max_metadata_value_chars} (checkpoints.max_metadata_value_chars)")
    return dict(meta) or None


def _short(text: str) -> str:
    return repr(text) if len(text) <= 64 else repr(text[:64]) + "..."
