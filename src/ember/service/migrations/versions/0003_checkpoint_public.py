"""checkpoints: a `public` flag (publish / unpublish_checkpoint_from_tinker_path)

Existing checkpoints stay private (server default false). `expires_at`, which TTLs use,
has been in the table since the baseline.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("checkpoints", sa.Column("public", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:  # SQLite drops columns by copying the table
        batch.drop_column("public")
