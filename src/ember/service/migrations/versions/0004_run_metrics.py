"""run_metrics: per-step metrics of training runs (the console's curves)

One row per forward_backward / forward / optim_step result of a run, bounded per run by
thinning (`ember.service.metric_history`). New table: existing databases get it empty.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "run_metrics",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(128), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_run_metrics_run_id_id", "run_metrics", ["run_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_run_metrics_run_id_id", table_name="run_metrics")
    op.drop_table("run_metrics")
