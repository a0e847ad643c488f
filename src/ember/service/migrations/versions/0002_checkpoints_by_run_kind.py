"""checkpoints: one index on (run_id, kind, created_at)

Every training-run listing asks for each run's newest checkpoint of each kind
(`Store.last_checkpoint`): with this index that is one index probe instead of a scan of
the run's checkpoints. It also serves `checkpoints_of_run`, so the old single-column
index on run_id is redundant and dropped.

Revision ID: 0002
Revises: 0001
Create Date: 2026-05-20
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_checkpoints_run_kind_created", "checkpoints", ["run_id", "kind", "created_at"])
    op.drop_index("ix_checkpoints_run_id", table_name="checkpoints")


def downgrade() -> None:
    op.create_index("ix_checkpoints_run_id", "checkpoints", ["run_id"])
    op.drop_index("ix_checkpoints_run_kind_created", table_name="checkpoints")
