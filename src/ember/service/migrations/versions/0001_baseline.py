"""baseline: the schema ember created with `create_all` before migrations existed

A database written by that code has these tables and no `alembic_version`; start-up
stamps it with this revision (`ember.service.migrations.upgrade`) instead of recreating it.

Revision ID: 0001
Revises:
Create Date: 2026-05-20
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# (table, column) pairs that had `index=True`: named ix_<table>_<column> by SQLAlchemy.
INDEXES = [
    ("sessions", "owner"), ("runs", "owner"), ("runs", "session_id"), ("checkpoints", "run_id"),
    ("checkpoints", "owner"), ("samplers", "owner"), ("samplers", "session_id"), ("futures", "owner"),
    ("futures", "status"),
]


def _sessions() -> None:
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(256), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=False),
        sa.Column("project_id", sa.String(256), nullable=True),
        sa.Column("display_name", sa.String(256), nullable=True),
        sa.Column("sdk_version", sa.String(64), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("finish_reason", sa.String(32), nullable=True),
        sa.Column("finish_detail", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("last_heartbeat", sa.Float(), nullable=False),
    )


def _runs() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("owner", sa.String(256), nullable=False),
        sa.Column("session_id", sa.String(64), nullable=False),
        sa.Column("model_seq_id", sa.Integer(), nullable=False),
        sa.Column("base_model", sa.String(512), nullable=False),
        sa.Column("is_lora", sa.Boolean(), nullable=False),
        sa.Column("lora_config", sa.JSON(), nullable=True),
        sa.Column("optimizer_config", sa.JSON(), nullable=True),
        sa.Column("user_metadata", sa.JSON(), nullable=True),
        sa.Column("created_from", sa.String(1024), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("last_request_time", sa.Float(), nullable=False),
    )


def _checkpoints() -> None:
    op.create_table(
        "checkpoints",
        sa.Column("tinker_path", sa.String(1024), primary_key=True),
        sa.Column("run_id", sa.String(128), nullable=False),
        sa.Column("owner", sa.String(256), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("directory", sa.String(2048), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("user_metadata", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=True),
    )


def _samplers() -> None:
    op.create_table(
        "samplers",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("owner", sa.String(256), nullable=False),
        sa.Column("session_id", sa.String(64), nullable=False),
        sa.Column("sampling_session_seq_id", sa.Integer(), nullable=True),
        sa.Column("base_model", sa.String(512), nullable=False),
        sa.Column("model_path", sa.String(1024), nullable=True),
        sa.Column("source_run_id", sa.String(128), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
    )


def _futures() -> None:
    op.create_table(
        "futures",
        sa.Column("request_id", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(256), nullable=False),
        sa.Column("request_type", sa.String(32), nullable=False),
        sa.Column("model_id", sa.String(128), nullable=True),
        sa.Column("dedup_key", sa.String(512), nullable=True),
        sa.Column("sample_sequence_ids", sa.JSON(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("payload", sa.LargeBinary(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("category", sa.String(16), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.UniqueConstraint("dedup_key"),
    )


def upgrade() -> None:
    for create in (_sessions, _runs, _checkpoints, _samplers, _futures):
        create()
    for table, column in INDEXES:
        op.create_index(f"ix_{table}_{column}", table, [column])


def downgrade() -> None:
    for table in ("futures", "samplers", "checkpoints", "runs", "sessions"):
        op.drop_table(table)
