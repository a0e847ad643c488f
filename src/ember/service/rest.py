"""REST listings: database rows → tinker's REST types (pure translation + owner filters).

Listings leave out checkpoints past their expiry (`ember.service.lifecycle`), whether or
not the sweep has deleted them yet."""

from __future__ import annotations

import time
from datetime import datetime, timezone

from tinker import types

from ember.service import checkpoints as ckpt
from ember.service import lifecycle
from ember.service.api import NotFoundError, UserError
from ember.service.limits import Limits
from ember.service.samplers import max_positions
from ember.service.engines import ModelRegistry
from ember.service.store import CheckpointRow, RunRow, Store


def _dt(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=timezone.utc)


def checkpoint_type(row: CheckpointRow) -> types.Checkpoint:
    tpath = ckpt.parse_tinker_path(row.tinker_path)
    return types.Checkpoint(
        checkpoint_id=tpath.checkpoint_id, checkpoint_type=row.kind, time=_dt(row.created_at),
        tinker_path=row.tinker_path, size_bytes=row.size_bytes, public=bool(row.public),
        user_metadata=row.user_metadata or None, expires_at=_dt(row.expires_at),
    )


def _last(store: Store, run_id: str, kind: str) -> types.Checkpoint | None:
    row = store.last_checkpoint(run_id, kind, time.time())
    return None if row is None else checkpoint_type(row)


def training_run(store: Store, row: RunRow) -> types.TrainingRun:
    meta = {str(k): str(v) for k, v in (row.user_metadata or {}).items()} or None
    return types.TrainingRun(
        training_run_id=row.id, base_model=row.base_model, model_owner=row.owner, is_lora=row.is_lora,
        corrupted=row.status == "failed", lora_rank=(row.lora_config or {}).get("rank") if row.is_lora else None,
        last_request_time=_dt(row.last_request_time), last_checkpoint=_last(store, row.id, "training"),
        last_sampler_checkpoint=_last(store, row.id, "sampler"), user_metadata=meta,
    )


def _page(limit: int, offset: int) -> tuple[int, int]:
    if not isinstance(limit, int) or not isinstance(offset, int) or limit < 0 or offset < 0:
        raise UserError(f"limit and offset must be integers >= 0, got limit={limit!r} offset={offset!r}")
    return limit, offset


def list_training_runs(store: Store, owner: str, limit: int, offset: int) -> types.TrainingRunsResponse:
    limit, offset = _page(limit, offset)
    total = store.count_runs(owner)
    rows = store.list_runs(owner, limit, offset)
    return types.TrainingRunsResponse(
        training_runs=[training_run(store, r) for r in rows],
        cursor=types.Cursor(offset=offset, limit=limit, total_count=int(total)),
    )


def run_row(store: Store, owner: str, run_id: str) -> RunRow:
    row = store.get(RunRow, run_id)
    if row is None or row.owner != owner:
        raise NotFoundError(f"unknown training run {run_id!r}")
    return row


def list_checkpoints(store: Store, owner: str, run_id: str) -> types.CheckpointsListResponse:
    run_row(store, owner, run_id)
    return types.CheckpointsListResponse(checkpoints=[checkpoint_type(r) for r in store.checkpoints_of_run(run_id, time.time())])


def list_user_checkpoints(store: Store, owner: str, limit: int, offset: int) -> types.CheckpointsListResponse:
    limit, offset = _page(limit, offset)
    now = time.time()
    total = store.count_checkpoints(owner, now)
    rows = store.list_checkpoints(owner, limit, offset, now)
    return types.CheckpointsListResponse(
        checkpoints=[checkpoint_type(r) for r in rows], cursor=types.Cursor(offset=offset, limit=limit, total_count=int(total))
    )


def weights_info(store: Store, owner: str, tinker_path: str) -> types.WeightsInfoResponse:
    """Of any checkpoint `owner` may read (its own, or a published one)."""
    _, row = lifecycle.readable(store, owner, tinker_path)
    run = store.get(RunRow, row.run_id)
    if run is None:
        raise NotFoundError(lifecycle.READ_REFUSED.format(path=tinker_path))
    lora = run.lora_config or {}
    return types.WeightsInfoResponse(
        base_model=run.base_model, is_lora=run.is_lora, lora_rank=lora.get("rank"),
        train_unembed=lora.get("train_unembed"), train_mlp=lora.get("train_mlp"), train_attn=lora.get("train_attn"),
    )


def capabilities(registry: ModelRegistry, limits: Limits) -> types.GetServerCapabilitiesResponse:
    """Registered models, each with the longest sequence it accepts: the model's positions
    capped by `limits.max_datum_tokens` when set (the SDK's only limit field; the README lists the rest)."""
    def context(name: str) -> int:
        return limits.datum_tokens(max_positions(registry.resolve(name).directory))[0]

    return types.GetServerCapabilitiesResponse(supported_models=[
        types.SupportedModel(model_name=n, trainable=True, sampleable=True, max_context_length=context(n))
        for n in registry.names()
    ])
