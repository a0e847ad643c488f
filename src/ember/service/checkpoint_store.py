"""`CheckpointStore`: every checkpoint operation, in one place.

A checkpoint is a row (`ember.service.tables.CheckpointRow`, the commit point) naming a
directory of files (`ember.service.checkpoint_files`: paths, layout, fsync, readers).
This module owns what happens to them:

* save: a fresh directory written by the caller's writer, the row committed, the
  replaced directory removed (crash-consistent; see `checkpoint_files`); the owner's
  checkpoint bytes quota (`limits.max_checkpoint_bytes_per_key`) checked before and after;
* access: every call that reads a checkpoint by path (a sampling session from
  `model_path`, a training run from its state, `load_state`, weights info, the OpenAI
  routes' `model=tinker://...`) goes through `readable`: the owner, or anyone while it is
  published. Every call that changes one (publish, unpublish, TTL, delete, export links)
  goes through `owned`. A checkpoint past its expiry is gone for both from that instant
  on, before the sweep deletes its files. Each refusal answers the same `NotFoundError`
  as a path never saved, so a caller learns nothing about checkpoints it may not see.
  Loading training state also takes a weights access token (`LoadWeightsRequest.
  weights_access_token`): one the owner made for that checkpoint (`access_token`) lets
  another key load it while it is private;
* publish, TTL, delete, the TTL sweep, the start-up sweep of interrupted saves;
* listings (REST) and external-weights download links.

The HTTP routes and `Service` call this class; nothing else touches checkpoint rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from tinker import types

from ember import failpoints
from ember.service import checkpoint_files as files
from ember.service import external
from ember.service.api import ExternalWeightsLinks, NotFoundError, UserError
from ember.service.clock import SYSTEM_CLOCK, Clock
from ember.service.config import CheckpointConfig
from ember.service.quotas import check_checkpoint_bytes, check_checkpoint_bytes_after
from ember.service.store import CheckpointRow, RunRow, Store
from ember.service.sweep import sweep_data_dir

log = logging.getLogger(__name__)

READ_REFUSED = "checkpoint {path!r} not found (or not visible to this API key)"
WRITE_REFUSED = "checkpoint {path!r} not found (or not owned by this API key)"
TOKEN_REFUSED = ("weights_access_token does not grant access to {path!r}: a token lets another API key load only "
                 "the checkpoint its owner made it for (POST /api/v1/training_runs/<run>/checkpoints/<id>/access_token), "
                 "until it expires or that checkpoint is overwritten or deleted; or the owner publishes the checkpoint")
ACCESS_TOKEN_TTL_S = 7 * 86400  # a weights access token's default lifetime
# A download link (same signer) binds the directory itself: this prefix keeps an access token
# from ever being a download link, and a link from being an access token.
ACCESS_DOMAIN = "weights-access:"

Writer = Callable[[Path], None]  # writes a checkpoint's files into a new directory
# A run's automatic save (`RunsConfig`: every N steps, and at a clean shutdown): one per run,
# replaced each time, listed like any training checkpoint (loadable by its owner) but outside
# the checkpoint bytes quota: the server made it, not the user (README "Restarts"). The same
# name of kind "sampler" is the run's weights that in-memory sampling sessions sampled from,
# saved at a clean shutdown (`SamplerManager.persist_snapshots`), quota-exempt as well.
AUTOSAVE_NAME = "ember-autosave"
AUTOMATIC_KINDS = ("training", "sampler")


# ---------------------------------------------------------------------- access (pure over a Store)
def expired(row: CheckpointRow, now: float) -> bool:
    return row.expires_at is not None and row.expires_at <= now


def _live_row(store: Store, path: object, now: float) -> tuple[files.TinkerPath, CheckpointRow | None]:
    tpath = files.parse_tinker_path(path)
    row = store.get(CheckpointRow, tpath.uri)
    return tpath, None if row is None or expired(row, now) else row


def readable(store: Store, owner: str, path: object, now: float) -> tuple[files.TinkerPath, CheckpointRow]:
    """The checkpoint at `path` if `owner` may read it (owns it, or it is published) and it
    has not expired by `now` (the service's clock)."""
    tpath, row = _live_row(store, path, now)
    if row is None or not (row.owner == owner or row.public):
        raise NotFoundError(READ_REFUSED.format(path=path))
    return tpath, row


def owned(store: Store, owner: str, path: object, now: float) -> tuple[files.TinkerPath, CheckpointRow]:
    """The checkpoint at `path` if `owner` owns it (publish, unpublish, TTL, delete)."""
    tpath, row = _live_row(store, path, now)
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


# ---------------------------------------------------------------------- save options
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


# ---------------------------------------------------------------------- REST translation (pure)
def _dt(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=timezone.utc)


def checkpoint_type(row: CheckpointRow) -> types.Checkpoint:
    tpath = files.parse_tinker_path(row.tinker_path)
    return types.Checkpoint(
        checkpoint_id=tpath.checkpoint_id, checkpoint_type=row.kind, time=_dt(row.created_at),
        tinker_path=row.tinker_path, size_bytes=row.size_bytes, public=bool(row.public),
        user_metadata=row.user_metadata or None, expires_at=_dt(row.expires_at),
    )


class CheckpointStore:
    """Saves, access checks, publish/TTL/delete, sweeps, listings and export links."""

    def __init__(self, store: Store, data_dir: Path, config: CheckpointConfig | None = None,
                 links: external.LinkSigner | None = None, quota_bytes: int | None = None,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.store, self.data_dir = store, Path(data_dir)
        self.config = config or CheckpointConfig()
        self.clock = clock  # TTLs and expiry (ember.service.clock)
        self._links = links or external.LinkSigner(external.load_secret(self.data_dir), clock)
        self.quota_bytes = quota_bytes  # None: no checkpoint bytes quota

    # ------------------------------------------------------------------ access
    def readable(self, owner: str, path: object) -> tuple[files.TinkerPath, CheckpointRow]:
        return readable(self.store, owner, path, self.clock())

    def training_state(self, owner: str, path: object,
                       access_token: str | None = None) -> tuple[files.TinkerPath, CheckpointRow]:
        """A `save_state` checkpoint `owner` may load (what a run is created from or loads):
        readable, or granted by `access_token` (a token is looked at only when needed)."""
        tpath, row = self._granted(owner, path, access_token)
        if tpath.kind != "training":
            raise UserError(f"checkpoint {path!r} holds sampler weights only; load training state from a "
                            "tinker://<run>/weights/<name> path (written by save_state)")
        return tpath, row

    def _granted(self, owner: str, path: object, token: str | None) -> tuple[files.TinkerPath, CheckpointRow]:
        try:
            return readable(self.store, owner, path, self.clock())
        except NotFoundError:
            if token is None:
                raise
        tpath, row = _live_row(self.store, path, self.clock())
        try:
            if row is None:
                raise NotFoundError(external.REFUSED)
            found, expires, mac = self._links.tinker_path_of(token)
            if found != row.tinker_path:
                raise NotFoundError(external.REFUSED)
            self._links.check(row.tinker_path, row.owner, ACCESS_DOMAIN + row.directory, expires, mac)
        except NotFoundError:
            raise UserError(TOKEN_REFUSED.format(path=path)) from None
        return tpath, row

    def access_token(self, owner: str, run_id: object, checkpoint_id: object,
                     ttl_seconds: Any = None) -> tuple[str, int]:
        """(token, expires): lets any API key load the owner's `weights/<name>` checkpoint
        (`weights_access_token`) for `ttl_seconds` (default 7 days), or until the
        checkpoint is overwritten or deleted."""
        ttl = check_ttl(ttl_seconds, self.config) or ACCESS_TOKEN_TTL_S
        row = self._owned_rest(owner, run_id, checkpoint_id)
        if files.parse_tinker_path(row.tinker_path).kind != "training":
            raise UserError(f"checkpoint_id: a weights access token is for training state ('weights/<name>', "
                            f"what load_state reads), got {checkpoint_id!r}")
        return self._links.sign(row.tinker_path, row.owner, ACCESS_DOMAIN + row.directory, ttl)

    def row(self, tinker_path: str) -> CheckpointRow | None:
        """Read-only: the checkpoint's database row (its directory, TTL, owner), or None, with
        no access check (the server's own saves, such as a snapshot save being restored
        (`service/sampler_snapshots.py`), diagnostics and tests; requests go through `readable`)."""
        return self.store.get(CheckpointRow, tinker_path)

    def _owned_rest(self, owner: str, run_id: object, checkpoint_id: object) -> CheckpointRow:
        return owned(self.store, owner, rest_path(run_id, checkpoint_id), self.clock())[1]

    # ------------------------------------------------------------------ save
    def save(self, run_id: str, owner: str, kind: str, name: Any, write: Writer, *, overwrite: bool,
             ttl_seconds: Any = None, user_metadata: Any = None) -> CheckpointRow:
        """Write a fresh directory with `write`, commit the row naming it, then drop the
        replaced one. A save that replaces a checkpoint makes a new one: private, with this
        save's TTL and metadata. Called on the run's lane."""
        tpath = files.TinkerPath(run_id, kind, files.validate_name(name))
        ttl = check_ttl(ttl_seconds, self.config)
        meta = check_metadata(user_metadata, self.config)
        existing = self.store.get(CheckpointRow, tpath.uri)
        if existing is not None and not overwrite and not expired(existing, self.clock()):
            raise UserError(f"checkpoint {tpath.uri} already exists; pass overwrite=True to replace it")
        automatic = kind in AUTOMATIC_KINDS and tpath.name == AUTOSAVE_NAME
        used = 0 if automatic else self._check_quota_before(owner)
        final = self._write(tpath, write)
        now = self.clock()
        row = CheckpointRow(
            tinker_path=tpath.uri, run_id=run_id, owner=owner, kind=kind, name=tpath.name, directory=str(final),
            size_bytes=files.dir_size(final), user_metadata=meta, created_at=now,
            expires_at=now + ttl if ttl else None, public=False,
        )
        if not automatic:
            self._check_quota_after(used, row, existing, final)
        try:
            self.store.save_checkpoint(row)  # the commit point
        except BaseException:
            self._drop_uncommitted(tpath, final)
            raise
        failpoints.hit("checkpoint.after_commit")
        log.info("checkpoint %s saved (%s, %.1f MB)", tpath.uri, kind, row.size_bytes / 1e6)
        if existing is not None and existing.directory != row.directory:
            files.remove_checkpoint_dir(self.data_dir, existing.directory)
        return row

    def _write(self, tpath: files.TinkerPath, write: Writer) -> Path:
        final = files.new_version_dir(self.data_dir, tpath)
        tmp = files.temp_dir_of(final)
        failpoints.hit("checkpoint.before_write")
        try:
            write(tmp)
            files.publish(tmp, final)
        finally:
            files.remove_dir(tmp)
        failpoints.hit("checkpoint.after_write")
        return final

    def _drop_uncommitted(self, tpath: files.TinkerPath, final: Path) -> None:
        """The row write failed: remove `final` unless the commit happened after all (a lost
        answer); when even that cannot be read, leave it to the start-up sweep."""
        try:
            row = self.store.get(CheckpointRow, tpath.uri)
        except Exception:  # noqa: BLE001 - the original error is what the caller sees
            return
        if row is None or row.directory != str(final):
            files.remove_dir(final)

    # ------------------------------------------------------------------ quota
    def bytes_used(self, owner: str) -> int:
        """Bytes of `owner`'s checkpoints not past their expiry, automatic saves left out (what
        the quota counts)."""
        return self.store.checkpoint_bytes(owner, self.clock(), except_name=AUTOSAVE_NAME)

    def _check_quota_before(self, owner: str) -> int:
        used = self.bytes_used(owner) if self.quota_bytes is not None else 0
        check_checkpoint_bytes(used, self.quota_bytes)
        return used

    def _check_quota_after(self, used: int, row: CheckpointRow, existing: CheckpointRow | None, final: Path) -> None:
        """The written size is known only now: over the quota, the new files go again."""
        if self.quota_bytes is None:
            return
        replaced = (existing.size_bytes or 0) if existing is not None and not expired(existing, self.clock()) else 0
        total = used - replaced + row.size_bytes
        try:
            check_checkpoint_bytes_after(row.tinker_path, row.size_bytes, total, self.quota_bytes)
        except UserError:
            files.remove_dir(final)
            raise

    # ------------------------------------------------------------------ publish, TTL, delete, sweeps
    def set_public(self, owner: str, run_id: object, checkpoint_id: object, public: bool) -> None:
        row = self._owned_rest(owner, run_id, checkpoint_id)
        if not self.store.update_checkpoint(row.tinker_path, row.directory, public=bool(public)):
            raise NotFoundError(WRITE_REFUSED.format(path=row.tinker_path))

    def set_ttl(self, owner: str, run_id: object, checkpoint_id: object, ttl_seconds: Any) -> None:
        ttl = check_ttl(ttl_seconds, self.config)
        row = self._owned_rest(owner, run_id, checkpoint_id)
        expires_at = None if ttl is None else self.clock() + ttl
        if not self.store.update_checkpoint(row.tinker_path, row.directory, expires_at=expires_at):
            raise NotFoundError(WRITE_REFUSED.format(path=row.tinker_path))

    def delete(self, owner: str, run_id: object, checkpoint_id: object) -> None:
        row = self._owned_rest(owner, run_id, checkpoint_id)
        if not self._remove(row):
            raise NotFoundError(WRITE_REFUSED.format(path=row.tinker_path))

    def _remove(self, row: CheckpointRow) -> bool:
        """Delete the row (if it still names the same save), then its directory."""
        if not self.store.delete_checkpoint(row.tinker_path, row.directory):
            return False
        files.remove_checkpoint_dir(self.data_dir, row.directory)
        return True

    def sweep_expired(self) -> int:
        """Delete every checkpoint past its expiry (row, then files); how many."""
        removed = 0
        for row in self.store.expired_checkpoints(self.clock()):
            if self._remove(row):
                removed += 1
                log.info("checkpoint %s expired (ttl)", row.tinker_path)
        return removed

    def sweep_interrupted(self) -> list[Path]:
        """At start-up, before any run or sampler exists: remove what interrupted saves
        (and samplers) of a killed lifetime left (`ember.service.sweep`)."""
        return sweep_data_dir(self.data_dir, self.store.checkpoint_directories())

    # ------------------------------------------------------------------ listings
    def of_run(self, run_id: str) -> list[CheckpointRow]:
        """The run's checkpoints not past their expiry, oldest first (no owner check)."""
        return self.store.checkpoints_of_run(run_id, self.clock())

    def list_run(self, run_id: str) -> types.CheckpointsListResponse:
        return types.CheckpointsListResponse(checkpoints=[checkpoint_type(r) for r in self.of_run(run_id)])

    def list_owner(self, owner: str, limit: int, offset: int) -> types.CheckpointsListResponse:
        now = self.clock()
        total = self.store.count_checkpoints(owner, now)
        rows = self.store.list_checkpoints(owner, limit, offset, now)
        return types.CheckpointsListResponse(checkpoints=[checkpoint_type(r) for r in rows],
                                             cursor=types.Cursor(offset=offset, limit=limit, total_count=int(total)))

    def last(self, run_id: str, kind: str) -> types.Checkpoint | None:
        row = self.store.last_checkpoint(run_id, kind, self.clock())
        return None if row is None else checkpoint_type(row)

    def weights_info(self, owner: str, tinker_path: str) -> types.WeightsInfoResponse:
        """Of any checkpoint `owner` may read (its own, or a published one)."""
        _, row = readable(self.store, owner, tinker_path, self.clock())
        run = self.store.get(RunRow, row.run_id)
        if run is None:
            raise NotFoundError(READ_REFUSED.format(path=tinker_path))
        lora = run.lora_config or {}
        return types.WeightsInfoResponse(
            base_model=run.base_model, is_lora=run.is_lora, lora_rank=lora.get("rank"),
            train_unembed=lora.get("train_unembed"), train_mlp=lora.get("train_mlp"), train_attn=lora.get("train_attn"),
        )

    # ------------------------------------------------------------------ reading files
    def sampling_weights(self, row: CheckpointRow, folder: Path | None = None) -> dict[str, torch.Tensor]:
        """The tensors a sampler loads from checkpoint `row` (found by `readable`): a
        `save_state`'s trained tensors, or a sampler export's safetensors. `folder`: a
        subfolder of a snapshot save holding an older version, as `snapshot_store.older_dir`
        checked it (a sampler save's layout), read instead of the save's own weights."""
        if folder is not None:
            return files.read_sampler_weights(folder)
        d = Path(row.directory)
        return files.read_state_weights(d) if row.kind == "training" else files.read_sampler_weights(d)

    def meta(self, row: CheckpointRow) -> dict | None:
        """A `save_state` checkpoint's metadata (`ember.engine.checkpoint.read_meta`: kind,
        head, optimizer); None when unreadable (loading or reading its weights reports it)."""
        from ember.engine.checkpoint import read_meta

        try:
            return read_meta(Path(row.directory))
        except (OSError, ValueError):
            return None

    def saved_head(self, row: CheckpointRow) -> str | None:
        """The output head a `save_state` checkpoint holds ("policy" when its metadata names
        none); None when the metadata is unreadable."""
        meta = self.meta(row)
        return None if meta is None else meta.get("head", "policy")

    def read_extra(self, row: CheckpointRow, name: str) -> str | None:
        """The text of file `name` that the save's writer put beside the weights (such as a
        snapshot save's record); None when absent or unreadable."""
        try:
            return (Path(row.directory) / files.validate_name(name)).read_text()
        except (OSError, ValueError):
            return None

    def extra_bytes(self, row: CheckpointRow, name: str) -> bytes | None:
        """The bytes of file `name` beside the weights (such as an automatic save's gradients
        not yet applied); None when absent. A file there that cannot be read raises (OSError)."""
        path = Path(row.directory) / files.validate_name(name)
        return path.read_bytes() if path.exists() else None

    # ------------------------------------------------------------------ external-weights links
    def external_links(self, owner: str, run_id: object, checkpoint_id: object) -> ExternalWeightsLinks:
        if not isinstance(checkpoint_id, str) or not checkpoint_id.startswith("external_weights/"):
            raise UserError(f"checkpoint_id: expected 'external_weights/<name>' (a save_weights_external export), "
                            f"got {checkpoint_id!r}")
        row = self._owned_rest(owner, run_id, checkpoint_id)  # expired = gone
        token, expires = self._links.sign(row.tinker_path, row.owner, row.directory)
        return ExternalWeightsLinks(tinker_path=row.tinker_path, directory=row.directory,
                                    files=external.export_files(Path(row.directory)), token=token, expires=expires)

    def open_external_file(self, token: object, file: object) -> str:
        path, expires, mac = self._links.tinker_path_of(token)
        row = self.store.get(CheckpointRow, path)
        if row is None or row.kind != "external" or expired(row, self.clock()):
            raise NotFoundError(external.REFUSED)
        self._links.check(row.tinker_path, row.owner, row.directory, expires, mac)
        return str(external.resolve_file(Path(row.directory), file))
