"""REST listings of training runs and the server's capabilities: database rows → tinker's
REST types (pure translation + owner filters). Checkpoint listings are
`ember.service.checkpoint_store.CheckpointStore`'s (they leave out checkpoints past their
expiry, whether or not the sweep has deleted them yet)."""

from __future__ import annotations

from datetime import datetime, timezone

from tinker import types

from ember.service.api import NotFoundError, UserError
from ember.service.checkpoint_store import CheckpointStore
from ember.service.limits import Limits
from ember.service.model_registry import ModelRegistry
from ember.service.samplers import max_positions
from ember.service.store import RunRow, SessionRow, Store


def _dt(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=timezone.utc)


def training_run(checkpoints: CheckpointStore, row: RunRow, session: SessionRow | None = None) -> types.TrainingRun:
    """The REST view of a run. `corrupted` (what `tinker run list` shows as "Failed", the
    console as "failed") is true when the run could not be created, or when its session
    ended "errored" (the client's script failed; the console shows that session so)."""
    meta = {str(k): str(v) for k, v in (row.user_metadata or {}).items()} or None
    errored = session is not None and session.finish_reason == "errored"
    return types.TrainingRun(
        training_run_id=row.id, base_model=row.base_model, model_owner=row.owner, is_lora=row.is_lora,
        corrupted=row.status == "failed" or errored,
        lora_rank=(row.lora_config or {}).get("rank") if row.is_lora else None,
        last_request_time=_dt(row.last_request_time), last_checkpoint=checkpoints.last(row.id, "training"),
        last_sampler_checkpoint=checkpoints.last(row.id, "sampler"), user_metadata=meta,
    )


def page(limit: int, offset: int) -> tuple[int, int]:
    if not isinstance(limit, int) or not isinstance(offset, int) or limit < 0 or offset < 0:
        raise UserError(f"limit and offset must be integers >= 0, got limit={limit!r} offset={offset!r}")
    return limit, offset


def list_training_runs(store: Store, checkpoints: CheckpointStore, owner: str, limit: int,
                       offset: int) -> types.TrainingRunsResponse:
    limit, offset = page(limit, offset)
    total = store.count_runs(owner)
    rows = store.list_runs(owner, limit, offset)
    sessions = {sid: store.get(SessionRow, sid) for sid in {r.session_id for r in rows}}
    return types.TrainingRunsResponse(
        training_runs=[training_run(checkpoints, r, sessions[r.session_id]) for r in rows],
        cursor=types.Cursor(offset=offset, limit=limit, total_count=int(total)),
    )


def run_row(store: Store, owner: str, run_id: str) -> RunRow:
    row = store.get(RunRow, run_id)
    if row is None or row.owner != owner:
        raise NotFoundError(f"unknown training run {run_id!r}")
    return row


def capabilities(registry: ModelRegistry, limits: Limits) -> types.GetServerCapabilitiesResponse:
    """Registered models, each with the longest sequence it accepts: the model's positions
    capped by `limits.max_datum_tokens` when set (the SDK's only limit field; the README lists the rest)."""
    def context(name: str) -> int:
        return limits.datum_tokens(max_positions(registry.resolve(name).directory))[0]

    return types.GetServerCapabilitiesResponse(supported_models=[
        types.SupportedModel(model_name=n, trainable=True, sampleable=True, max_context_length=context(n))
        for n in registry.names()
    ])
