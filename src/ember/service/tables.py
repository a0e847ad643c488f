"""The database schema as ORM tables: sessions, training runs, checkpoints, samplers, futures,
per-step metrics.

This is the schema the code expects *at head*; every change to it comes with a migration
in `ember.service.migrations.versions` (a test checks that upgrading to head yields
exactly these tables, for SQLite and PostgreSQL).
"""

from __future__ import annotations

from sqlalchemy import JSON, false, BigInteger, Boolean, Float, Index, Integer, LargeBinary, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class SessionRow(Base):
    __tablename__ = "sessions"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(256), index=True)
    tags: Mapped[list] = mapped_column(JSON, default=list)
    user_metadata: Mapped[dict] = mapped_column(JSON, default=dict)
    project_id: Mapped[str | None] = mapped_column(String(256), nullable=True)
    display_name: Mapped[str | None] = mapped_column(String(256), nullable=True)
    sdk_version: Mapped[str | None] = mapped_column(String(64), nullable=True)
    status: Mapped[str] = mapped_column(String(16), default="active")  # active | finished | expired
    finish_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    finish_detail: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    last_heartbeat: Mapped[float] = mapped_column(Float)


class RunRow(Base):
    __tablename__ = "runs"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)  # "{session_id}:train:{n}"
    owner: Mapped[str] = mapped_column(String(256), index=True)
    session_id: Mapped[str] = mapped_column(String(64), index=True)
    model_seq_id: Mapped[int] = mapped_column(Integer)
    base_model: Mapped[str] = mapped_column(String(512))
    is_lora: Mapped[bool] = mapped_column(Boolean)
    lora_config: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    optimizer_config: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    user_metadata: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    created_from: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    status: Mapped[str] = mapped_column(String(16), default="active")  # active | failed | unloaded
    created_at: Mapped[float] = mapped_column(Float)
    last_request_time: Mapped[float] = mapped_column(Float)


class CheckpointRow(Base):
    __tablename__ = "checkpoints"
    # A run's checkpoints by kind, newest last (listings, last checkpoint): migration 0002.
    __table_args__ = (Index("ix_checkpoints_run_kind_created", "run_id", "kind", "created_at"),)
    tinker_path: Mapped[str] = mapped_column(String(1024), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(128))
    owner: Mapped[str] = mapped_column(String(256), index=True)
    kind: Mapped[str] = mapped_column(String(16))  # training | sampler
    name: Mapped[str] = mapped_column(String(256))
    directory: Mapped[str] = mapped_column(String(2048))
    size_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    user_metadata: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # Readable by every API key while True (publish_checkpoint_from_tinker_path): migration 0003.
    public: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class SamplerRow(Base):
    __tablename__ = "samplers"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    owner: Mapped[str] = mapped_column(String(256), index=True)
    session_id: Mapped[str] = mapped_column(String(64), index=True)
    sampling_session_seq_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    base_model: Mapped[str] = mapped_column(String(512))
    model_path: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    source_run_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    created_at: Mapped[float] = mapped_column(Float)


class FutureRow(Base):
    __tablename__ = "futures"
    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(256), index=True)
    request_type: Mapped[str] = mapped_column(String(32))
    model_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    dedup_key: Mapped[str | None] = mapped_column(String(512), unique=True, nullable=True)
    sample_sequence_ids: Mapped[list | None] = mapped_column(JSON, nullable=True)
    status: Mapped[str] = mapped_column(String(16), default="pending", index=True)  # pending|complete|failed
    payload: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    category: Mapped[str | None] = mapped_column(String(16), nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class MetricRow(Base):
    """One op's metrics (forward_backward, forward or optim_step) of a training run: the
    console's curves (`ember.service.metric_history`). Migration 0004."""

    __tablename__ = "run_metrics"
    # A run's rows in insertion (= step) order: the curves and the thinning read exactly these.
    __table_args__ = (Index("ix_run_metrics_run_id_id", "run_id", "id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(128))
    step: Mapped[int] = mapped_column(Integer)  # optim_steps the run had taken before this op
    kind: Mapped[str] = mapped_column(String(16))  # forward_backward | forward | optim_step
    metrics: Mapped[dict] = mapped_column(JSON)
    created_at: Mapped[float] = mapped_column(Float)
