"""Persistence with SQLAlchemy 2.x: sessions, training runs, checkpoints, samplers, futures.

A SQLite file in the data directory by default (WAL journal, `synchronous=NORMAL`: a
committed row survives `kill -9` of the server), any SQLAlchemy URL (PostgreSQL) by
config. Rows are written *before* work is queued (a submission is accepted only once its
future row is committed) and results are written before they are signalled, so nothing
accepted vanishes across a crash.

Result payloads are stored as `pickle` of the tinker result object (pydantic models and
the frozen numpy-backed dataclasses `ForwardBackwardOutput` / `SampleResponse`). Pickle
keeps them bit-exact and cheap; the database is private to the server (it never
unpickles data from clients), and the payload is re-created by the same tinker version
that wrote it. A payload that no longer unpickles (tinker upgraded between restarts) is
reported as a `server` failure of that future.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import (
    JSON, BigInteger, Boolean, Float, Integer, LargeBinary, String, Text, create_engine, delete, event, insert, select,
    update,
)
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker


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
    tinker_path: Mapped[str] = mapped_column(String(1024), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(128), index=True)
    owner: Mapped[str] = mapped_column(String(256), index=True)
    kind: Mapped[str] = mapped_column(String(16))  # training | sampler
    name: Mapped[str] = mapped_column(String(256))
    directory: Mapped[str] = mapped_column(String(2048))
    size_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    user_metadata: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)


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


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, pool_pre_ping=True)


def dump_payload(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def load_payload(blob: bytes) -> Any:
    return pickle.loads(blob)


class Store:
    """Thin transactional helpers over the tables. Rows come back detached (read-only use)."""

    def __init__(self, url: str) -> None:
        self.engine = make_engine(url)
        Base.metadata.create_all(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        # SQLite allows one writer; serialising writes here avoids busy-waiting in the driver.
        self._write_lock = threading.Lock()

    @contextmanager
    def write(self) -> Iterator[Session]:
        with self._write_lock, self._sessions.begin() as s:
            yield s

    @contextmanager
    def read(self) -> Iterator[Session]:
        with self._sessions() as s:
            yield s

    def add(self, row: Base) -> None:
        with self.write() as s:
            s.add(row)

    def get(self, cls: type, key: Any):
        with self.read() as s:
            return s.get(cls, key)

    @contextmanager
    def write_core(self) -> Iterator[Connection]:
        """A Core transaction (no ORM unit of work): ~4x cheaper for single statements."""
        with self._write_lock, self.engine.begin() as conn:
            yield conn

    def update(self, cls: type, key: Any, **values: Any) -> None:
        pk = cls.__mapper__.primary_key[0]
        with self.write_core() as conn:
            conn.execute(update(cls).where(pk == key).values(**values))

    def select_all(self, stmt) -> list:
        with self.read() as s:
            return list(s.scalars(stmt))

    def insert_future(self, values: dict[str, Any]) -> bool:
        """Insert a future row (Core insert: cheaper than the ORM unit of work). False if
        its dedup_key is taken."""
        try:
            with self.write_core() as conn:
                conn.execute(insert(FutureRow).values(**values))
            return True
        except IntegrityError:
            return False

    def future_by_key(self, dedup_key: str) -> FutureRow | None:
        with self.read() as s:
            return s.scalars(select(FutureRow).where(FutureRow.dedup_key == dedup_key)).first()

    def fail_pending_futures(self, message: str) -> int:
        """At start-up: every future a previous server lifetime left pending fails (server)."""
        with self.write() as s:
            res = s.execute(
                update(FutureRow)
                .where(FutureRow.status == "pending")
                .values(status="failed", error=message, category="server", finished_at=time.time())
            )
            return int(res.rowcount or 0)

    def unload_active_runs(self) -> int:
        """At start-up: runs of a previous lifetime have no engine any more."""
        with self.write() as s:
            res = s.execute(update(RunRow).where(RunRow.status == "active").values(status="unloaded"))
            return int(res.rowcount or 0)

    def prune_futures(self, finished_before: float) -> int:
        with self.write() as s:
            res = s.execute(
                delete(FutureRow).where(FutureRow.status != "pending", FutureRow.finished_at < finished_before)
            )
            return int(res.rowcount or 0)

    def expired_checkpoints(self, now: float) -> list[CheckpointRow]:
        return self.select_all(
            select(CheckpointRow).where(CheckpointRow.expires_at.is_not(None), CheckpointRow.expires_at < now)
        )

    def close(self) -> None:
        self.engine.dispose()
