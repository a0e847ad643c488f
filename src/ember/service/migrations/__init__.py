"""Schema migrations (Alembic), run from the installed package: no alembic.ini on disk.

`upgrade(engine)` brings any database to the newest revision; `Store` calls it at
start-up, `ember db upgrade` on demand. A database created by ember before migrations
existed (tables made by `create_all`, no `alembic_version`) is stamped as the baseline
revision 0001 first, then upgraded: its rows are kept.

New revision: `alembic -c <(echo) revision` does not apply (no ini); write the file by hand
in versions/ (`NNNN_what.py`, `down_revision` = the previous head) and change
`ember.service.tables` to match: a test compares the two.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, Engine

log = logging.getLogger(__name__)

BASELINE = "0001"
# Tables of the pre-migration schema; their presence without alembic_version means "stamp".
LEGACY_TABLES = {"sessions", "runs", "checkpoints", "samplers", "futures"}
# Any constant: concurrent start-ups on one PostgreSQL database migrate one at a time.
_PG_LOCK_KEY = 0x656D626572  # "ember"


def alembic_config(connection: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).parent))
    cfg.attributes["connection"] = connection
    return cfg


@functools.lru_cache(maxsize=1)
def head() -> str:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


@functools.lru_cache(maxsize=1)
def known_revisions() -> frozenset[str]:
    return frozenset(sc.revision for sc in ScriptDirectory.from_config(alembic_config()).walk_revisions())


def current(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


def _is_legacy(conn: Connection) -> bool:
    tables = set(inspect(conn).get_table_names())
    return "alembic_version" not in tables and LEGACY_TABLES <= tables


def upgrade(engine: Engine, revision: str = "head") -> str | None:
    """Migrate the database of `engine` to `revision`; returns the revision it is at after."""
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK_KEY})
        cfg = alembic_config(conn)
        target = head() if revision == "head" else revision
        before = current(conn)
        if before == target:  # the usual start-up: nothing to do, and cheap
            return before
        if before is not None and before not in known_revisions():
            raise RuntimeError(f"the database schema is at revision {before}, which this ember does not know "
                               f"(its newest is {target}): it was written by a newer ember; run that one")
        if before is None and _is_legacy(conn):
            log.warning("database without migration history: stamping it as revision %s (baseline)", BASELINE)
            command.stamp(cfg, BASELINE)
            before = BASELINE
        command.upgrade(cfg, revision)
        after = current(conn)
        log.info("database migrated from %s to %s", before, after)
        return after
