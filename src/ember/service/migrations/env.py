"""Alembic environment of ember's schema: runs on the connection `ember.service.migrations`
hands over (there is no alembic.ini and no URL here)."""

from __future__ import annotations

from alembic import context

from ember.service.tables import Base

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    # SQLite cannot ALTER most things: alembic rebuilds the table ("batch") instead.
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
