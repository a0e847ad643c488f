"""Persistence with SQLAlchemy 2.x: every query of the service lives here, as a named method.

A SQLite file in the data directory by default (WAL journal, `synchronous=NORMAL`: a
committed row survives `kill -9` of the server), PostgreSQL by URL
(`postgresql+psycopg://...`). The schema (`ember.service.tables`) is brought to the
newest migration at start-up (`ember.service.migrations`). Rows are written *before*
work is queued (a submission is accepted only once its future row is committed) and
results are written before they are signalled, so nothing accepted vanishes across a crash.

Result payloads are stored as `pickle` of the tinker result object (pydantic models and
the frozen numpy-backed dataclasses `ForwardBackwardOutput` / `SampleResponse`). Pickle
keeps them bit-exact and cheap; the database is private to the server (it never
unpickles data from clients), and the payload is re-created by the same tinker version
that wrote it. A payload that no longer unpickles (tinker upgraded between restarts) is
reported as a `server` failure of that future.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import String, create_engine, delete, event, func, insert, or_, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from ember.service.faults import StoreBusy
from ember.service.tables import Base, CheckpointRow, FutureRow, MetricRow, RunRow, SamplerRow, SessionRow

__all__ = [
    "Base", "CheckpointRow", "FutureRow", "MetricRow", "RunRow", "SamplerRow", "SessionRow", "Store",
    "default_database_url", "dump_payload", "load_payload", "make_engine",
]

# Connections a PostgreSQL pool keeps for the server's threads (HTTP worker threads, one
# lane per run, housekeeping); bursts beyond it open short-lived extra connections.
PG_POOL_SIZE = 16
PG_MAX_OVERFLOW = 32


def default_database_url(data_dir: str | Path) -> str:
    """The SQLite file used when no database URL is configured."""
    return f"sqlite:///{Path(data_dir) / 'ember.db'}"


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def _sqlite_pragmas(busy_ms: int, dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute(f"PRAGMA busy_timeout={int(busy_ms)}")
    cur.close()


def make_engine(url: str, lock_timeout_s: float = 5.0) -> Engine:
    """`lock_timeout_s`: how long one statement waits for a lock another connection holds
    (SQLite's busy timeout, PostgreSQL's lock_timeout) before it fails."""
    ms = max(1, int(lock_timeout_s * 1000))
    if is_sqlite(url):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": lock_timeout_s})
        event.listen(engine, "connect", functools.partial(_sqlite_pragmas, ms))
        return engine
    # pre_ping: a connection the database dropped (restart, idle timeout) is replaced, not
    # handed to a request that would then fail.
    connect_args = {"options": f"-c lock_timeout={ms}"} if url.startswith("postgresql") else {}
    return create_engine(url, pool_pre_ping=True, pool_size=PG_POOL_SIZE, max_overflow=PG_MAX_OVERFLOW,
                         pool_timeout=30, pool_recycle=3600, connect_args=connect_args)


class _TurnLock:
    """SQLite's one-writer rule kept inside the process, with a bounded wait for the turn
    (a writer stuck behind another process's lock must not queue every thread for ever)."""

    def __init__(self, wait_s: float) -> None:
        self._lock, self._wait_s = threading.Lock(), wait_s

    def __enter__(self) -> None:
        if not self._lock.acquire(timeout=self._wait_s):
            raise StoreBusy(f"the database stayed locked for more than {self._wait_s:g} s")

    def __exit__(self, *exc) -> None:
        self._lock.release()


@functools.cache
def _length_limits(cls: type) -> dict[str, int]:
    return {c.key: c.type.length for c in cls.__table__.columns if isinstance(c.type, String) and c.type.length}


def check_lengths(cls: type, values: Mapping[str, Any]) -> None:
    """PostgreSQL refuses a string longer than its VARCHAR column (SQLite stores it): refuse
    it on every database, as the caller's error naming the field, before writing."""
    for name, limit in _length_limits(cls).items():
        value = values.get(name)
        if isinstance(value, str) and len(value) > limit:
            from ember.service.api import UserError  # here: `ember db` and `ember limits` load without tinker (torch)

            raise UserError(f"{name} is too long: {len(value)} characters, at most {limit}")


def _row_values(row: Base) -> dict[str, Any]:
    return {name: getattr(row, name, None) for name in _length_limits(type(row))}


def dump_payload(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def load_payload(blob: bytes) -> Any:
    return pickle.loads(blob)


class _Db:
    """Connections and transactions. Rows come back detached (read-only use)."""

    def __init__(self, url: str, migrate: bool = True, lock_timeout_s: float = 5.0) -> None:
        self.url = url
        self.engine = make_engine(url, lock_timeout_s)
        if migrate:
            from ember.service.migrations import upgrade  # alembic: only where a Store is opened

            upgrade(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        # SQLite allows one writer; serialising writes here avoids busy-waiting in the driver.
        # PostgreSQL has row locks and MVCC: writers must not queue behind each other.
        # The wait for the turn is bounded like the wait for the lock: writers queued behind one
        # that waits out another process's lock give up too, as a StoreBusy the caller can
        # retry. One write so fails within 2 x lock_timeout_s.
        self._write_lock = _TurnLock(lock_timeout_s) if is_sqlite(url) else contextlib.nullcontext()

    @contextmanager
    def _write(self) -> Iterator[Session]:
        with self._write_lock, self._sessions.begin() as s:
            yield s

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with self._sessions() as s:
            yield s

    @contextmanager
    def _write_core(self) -> Iterator[Connection]:
        """A Core transaction (no ORM unit of work): ~4x cheaper for single statements."""
        with self._write_lock, self.engine.begin() as conn:
            yield conn

    def _all(self, stmt) -> list:
        with self._read() as s:
            return list(s.scalars(stmt))

    def _changed(self, stmt) -> int:
        with self._write_core() as conn:
            return int(conn.execute(stmt).rowcount or 0)

    # ------------------------------------------------------------------ any table, by primary key
    def add(self, row: Base) -> None:
        check_lengths(type(row), _row_values(row))
        with self._write() as s:
            s.add(row)

    def get(self, cls: type, key: Any):
        with self._read() as s:
            return s.get(cls, key)

    def update(self, cls: type, key: Any, **values: Any) -> None:
        check_lengths(cls, values)
        pk = cls.__mapper__.primary_key[0]
        self._changed(update(cls).where(pk == key).values(**values))

    def close(self) -> None:
        self.engine.dispose()


def _unexpired(now: float):
    return or_(CheckpointRow.expires_at.is_(None), CheckpointRow.expires_at > now)


class Store(_Db):
    """The service's queries, by table."""

    # ------------------------------------------------------------------ sessions
    def stale_sessions(self, heartbeat_before: float) -> list[SessionRow]:
        return self._all(
            select(SessionRow).where(SessionRow.status == "active", SessionRow.last_heartbeat < heartbeat_before)
        )

    def count_active_sessions(self, owner: str) -> int:
        return int(self._all(select(func.count()).select_from(SessionRow)
                             .where(SessionRow.owner == owner, SessionRow.status == "active"))[0])

    def active_sessions(self) -> list[SessionRow]:
        return self._all(select(SessionRow).where(SessionRow.status == "active"))

    def list_session_ids(self, owner: str, limit: int, offset: int) -> list[str]:
        return self._all(
            select(SessionRow.id).where(SessionRow.owner == owner)
            .order_by(SessionRow.created_at.desc()).limit(max(0, limit)).offset(max(0, offset))
        )

    def run_ids_of_session(self, session_id: str) -> list[str]:
        return self._all(select(RunRow.id).where(RunRow.session_id == session_id).order_by(RunRow.created_at))

    def sampler_ids_of_session(self, session_id: str) -> list[str]:
        return self._all(
            select(SamplerRow.id).where(SamplerRow.session_id == session_id).order_by(SamplerRow.created_at)
        )

    # ------------------------------------------------------------------ runs
    def count_runs(self, owner: str) -> int:
        return int(self._all(select(func.count()).select_from(RunRow).where(RunRow.owner == owner))[0])

    def list_runs(self, owner: str, limit: int, offset: int) -> list[RunRow]:
        """Newest first (ties by id, so pages never overlap)."""
        return self._all(
            select(RunRow).where(RunRow.owner == owner).order_by(RunRow.created_at.desc(), RunRow.id)
            .limit(limit).offset(offset)
        )

    def unload_active_runs(self) -> int:
        """At start-up: runs of a previous lifetime have no engine any more."""
        return self._changed(update(RunRow).where(RunRow.status == "active").values(status="unloaded"))

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, row: CheckpointRow) -> None:
        """Insert or replace (overwrite=True) the checkpoint row of `row.tinker_path`."""
        check_lengths(CheckpointRow, _row_values(row))
        with self._write() as s:
            s.merge(row)

    def delete_checkpoint(self, tinker_path: str, directory: str | None = None) -> bool:
        """False if there was no such checkpoint (e.g. deleted concurrently), or, given
        `directory`, its row names another one now (overwritten since it was read)."""
        where = [CheckpointRow.tinker_path == tinker_path]
        if directory is not None:
            where.append(CheckpointRow.directory == directory)
        return self._changed(delete(CheckpointRow).where(*where)) > 0

    def checkpoints_of_run(self, run_id: str, now: float) -> list[CheckpointRow]:
        """The run's checkpoints not expired at `now`, oldest first."""
        return self._all(
            select(CheckpointRow).where(CheckpointRow.run_id == run_id, _unexpired(now))
            .order_by(CheckpointRow.created_at)
        )

    def last_checkpoint(self, run_id: str, kind: str, now: float) -> CheckpointRow | None:
        rows = self._all(
            select(CheckpointRow).where(CheckpointRow.run_id == run_id, CheckpointRow.kind == kind, _unexpired(now))
            .order_by(CheckpointRow.created_at.desc()).limit(1)
        )
        return rows[0] if rows else None

    def count_checkpoints(self, owner: str, now: float) -> int:
        return int(self._all(select(func.count()).select_from(CheckpointRow)
                             .where(CheckpointRow.owner == owner, _unexpired(now)))[0])

    def checkpoint_bytes(self, owner: str, now: float, except_name: str | None = None) -> int:
        """Total `size_bytes` of `owner`'s checkpoints not expired at `now` (the bytes quota),
        leaving out those named `except_name` (the automatic saves)."""
        where = [CheckpointRow.owner == owner, _unexpired(now)]
        if except_name is not None:
            where.append(CheckpointRow.name != except_name)
        return int(self._all(select(func.coalesce(func.sum(CheckpointRow.size_bytes), 0)).where(*where))[0])

    def list_checkpoints(self, owner: str, limit: int, offset: int, now: float) -> list[CheckpointRow]:
        return self._all(
            select(CheckpointRow).where(CheckpointRow.owner == owner, _unexpired(now))
            .order_by(CheckpointRow.created_at.desc(), CheckpointRow.tinker_path).limit(limit).offset(offset)
        )

    def update_checkpoint(self, tinker_path: str, directory: str, **values: Any) -> bool:
        """Change a checkpoint's `public` / `expires_at`, only if its row still names
        `directory` (not deleted or overwritten since it was read); False otherwise."""
        return self._changed(
            update(CheckpointRow).where(CheckpointRow.tinker_path == tinker_path,
                                        CheckpointRow.directory == directory).values(**values)
        ) > 0

    def checkpoint_directories(self) -> list[str]:
        """The directory of every checkpoint row (the start-up sweep keeps exactly these)."""
        return self._all(select(CheckpointRow.directory))

    def expired_checkpoints(self, now: float) -> list[CheckpointRow]:
        return self._all(
            select(CheckpointRow).where(CheckpointRow.expires_at.is_not(None), CheckpointRow.expires_at <= now)
        )

    # ------------------------------------------------------------------ samplers
    def sampler_by_seq(self, session_id: str, seq: int) -> SamplerRow | None:
        rows = self._all(
            select(SamplerRow).where(SamplerRow.session_id == session_id, SamplerRow.sampling_session_seq_id == seq)
        )
        return rows[0] if rows else None

    # ------------------------------------------------------------------ futures
    def insert_future(self, values: dict[str, Any]) -> bool:
        """Insert a future row (Core insert: cheaper than the ORM unit of work). False if
        its dedup_key is taken."""
        check_lengths(FutureRow, values)
        try:
            with self._write_core() as conn:
                conn.execute(insert(FutureRow).values(**values))
            return True
        except IntegrityError:
            return False

    def future_by_key(self, dedup_key: str) -> FutureRow | None:
        with self._read() as s:
            return s.scalars(select(FutureRow).where(FutureRow.dedup_key == dedup_key)).first()

    def fail_pending_futures(self, message: str, now: float) -> int:
        """At start-up: every future a previous server lifetime left pending fails (server), finished at `now`."""
        return self._changed(
            update(FutureRow).where(FutureRow.status == "pending")
            .values(status="failed", error=message, category="server", finished_at=now)
        )

    def prune_futures(self, finished_before: float) -> int:
        return self._changed(
            delete(FutureRow).where(FutureRow.status != "pending", FutureRow.finished_at < finished_before)
        )

    def pending_future_ids(self, created_before: float) -> list[str]:
        """Futures still pending that were accepted before `created_before` (the stuck-future sweep)."""
        return self._all(
            select(FutureRow.request_id).where(FutureRow.status == "pending", FutureRow.created_at < created_before)
        )

    def fail_future_if_pending(self, request_id: str, message: str, now: float) -> bool:
        """End one pending future as a server failure at `now`; False if it had finished meanwhile."""
        return self._changed(
            update(FutureRow).where(FutureRow.request_id == request_id, FutureRow.status == "pending")
            .values(status="failed", error=message, category="server", finished_at=now)
        ) > 0

    # ------------------------------------------------------------------ per-step metrics
    def insert_metrics(self, values: dict[str, Any]) -> None:
        """One op's metrics row (Core insert: the training path's only cost of the history)."""
        with self._write_core() as conn:
            conn.execute(insert(MetricRow).values(**values))

    def metric_rows(self, run_id: str) -> list[MetricRow]:
        """The run's metric rows, oldest first."""
        return self._all(select(MetricRow).where(MetricRow.run_id == run_id).order_by(MetricRow.id))

    def metric_row_steps(self, run_id: str) -> list[tuple[int, int]]:
        """(id, step) of the run's metric rows, oldest first (what thinning decides on)."""
        with self._read() as s:
            return [(int(i), int(st)) for i, st in s.execute(
                select(MetricRow.id, MetricRow.step).where(MetricRow.run_id == run_id).order_by(MetricRow.id))]

    def delete_metric_rows(self, ids: list[int]) -> int:
        deleted = 0
        for i in range(0, len(ids), 500):  # bounded statements (SQLite's variable limit)
            deleted += self._changed(delete(MetricRow).where(MetricRow.id.in_(ids[i:i + 500])))
        return deleted

    def steps_taken(self, run_ids: list[str]) -> dict[str, int]:
        """run_id -> optim_steps recorded (the newest optim_step row is never thinned away)."""
        if not run_ids:
            return {}
        with self._read() as s:
            found = s.execute(select(MetricRow.run_id, func.max(MetricRow.step))
                              .where(MetricRow.run_id.in_(run_ids), MetricRow.kind == "optim_step")
                              .group_by(MetricRow.run_id)).all()
        return {run_id: int(top) + 1 for run_id, top in found}
