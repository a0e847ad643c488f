"""Schema migrations on SQLite and PostgreSQL: head equals the ORM tables, the baseline
equals what ember created before migrations existed, and such a database upgrades in
place keeping its sessions, runs, checkpoints and futures."""

from __future__ import annotations

import time

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Index, MetaData, Table, inspect, text
from tinker import types

from ember.cli import main as ember_main
from ember.service import Service, ServiceConfig, migrations
from ember.service.store import Base, dump_payload, make_engine

OWNER = "alice"
SESSION = "sess-legacy"
RUN = f"{SESSION}:train:0"


def legacy_metadata() -> MetaData:
    """The tables as ember's `create_all` made them before migration 0002 (no index on
    (run_id, kind, created_at), no checkpoints.public: 0003, no run_metrics: 0004)."""
    md = MetaData()
    for table in Base.metadata.tables.values():
        if table.name == "run_metrics":
            continue
        if table.name == "checkpoints":
            Table(table.name, md, *[c._copy() for c in table.columns if c.name != "public"])
        else:
            table.to_metadata(md)
    ck = md.tables["checkpoints"]  # rebuilt from its columns: without the composite index
    Index("ix_checkpoints_run_id", ck.c.run_id)
    return md


def schema_diff(engine, metadata: MetaData) -> list:
    with engine.connect() as conn:
        return compare_metadata(MigrationContext.configure(conn), metadata)


@pytest.fixture
def engine(database_url):
    eng = make_engine(database_url)
    yield eng
    eng.dispose()


def test_upgrade_to_head_creates_exactly_the_orm_tables(engine):
    assert migrations.upgrade(engine) == migrations.head() == "0004"
    assert schema_diff(engine, Base.metadata) == []
    assert migrations.upgrade(engine) == "0004"  # idempotent


def test_baseline_is_the_pre_migration_schema(engine):
    migrations.upgrade(engine, "0001")
    assert schema_diff(engine, legacy_metadata()) == []
    assert schema_diff(engine, Base.metadata) != []  # 0002 and 0003 are real changes


def _legacy_rows(conn) -> None:
    md, now = legacy_metadata(), time.time()
    t = md.tables
    conn.execute(t["sessions"].insert().values(
        id=SESSION, owner=OWNER, tags=["x"], user_metadata={"k": "v"}, status="active", created_at=now,
        last_heartbeat=now))
    conn.execute(t["runs"].insert().values(
        id=RUN, owner=OWNER, session_id=SESSION, model_seq_id=0, base_model="tiny", is_lora=True,
        lora_config={"rank": 4}, optimizer_config={"type": "adamw"}, status="active", created_at=now,
        last_request_time=now))
    for i, (kind, seg) in enumerate([("training", "weights"), ("sampler", "sampler_weights"), ("training", "weights")]):
        conn.execute(t["checkpoints"].insert().values(
            tinker_path=f"tinker://{RUN}/{seg}/ck{i}", run_id=RUN, owner=OWNER, kind=kind, name=f"ck{i}",
            directory=f"/nowhere/ck{i}", size_bytes=10 * i, created_at=now + i))
    conn.execute(t["futures"].insert().values(
        request_id="req-done", owner=OWNER, request_type="OptimStep", model_id=RUN, dedup_key=f"op:{RUN}:1",
        status="complete", payload=dump_payload(types.OptimStepResponse(metrics={"lr": 0.5})), created_at=now,
        finished_at=now))
    conn.execute(t["futures"].insert().values(
        request_id="req-bad", owner=OWNER, request_type="ForwardBackward", model_id=RUN, status="failed",
        error="bad datum 0", category="user", created_at=now, finished_at=now))
    conn.execute(t["futures"].insert().values(
        request_id="req-pending", owner=OWNER, request_type="ForwardBackward", model_id=RUN,
        dedup_key=f"op:{RUN}:2", status="pending", created_at=now))


def test_database_of_the_old_code_upgrades_keeping_its_rows(engine, database_url, tmp_path, tiny_model_dir):
    legacy_metadata().create_all(engine)  # exactly what the old Store did at start-up
    with engine.begin() as conn:
        _legacy_rows(conn)
    svc = Service(ServiceConfig(data_dir=tmp_path / "data", database_url=database_url,
                                models={"tiny": str(tiny_model_dir)}))
    try:
        with engine.connect() as conn:
            assert migrations.current(conn) == migrations.head()
        assert schema_diff(engine, Base.metadata) == []
        runs = svc.list_training_runs(OWNER).training_runs
        assert [r.training_run_id for r in runs] == [RUN] and runs[0].lora_rank == 4
        assert runs[0].last_checkpoint.tinker_path == f"tinker://{RUN}/weights/ck2"
        assert runs[0].last_sampler_checkpoint.tinker_path == f"tinker://{RUN}/sampler_weights/ck1"
        paths = [c.tinker_path for c in svc.list_checkpoints(OWNER, RUN).checkpoints]
        assert paths == [f"tinker://{RUN}/weights/ck0", f"tinker://{RUN}/sampler_weights/ck1",
                         f"tinker://{RUN}/weights/ck2"]
        assert [c.public for c in svc.list_checkpoints(OWNER, RUN).checkpoints] == [False] * 3  # 0003's default
        assert svc.get_session(OWNER, SESSION).training_run_ids == [RUN]
        done = svc.retrieve(OWNER, "req-done")
        assert done.status == "complete" and done.result.metrics == {"lr": 0.5}
        bad = svc.retrieve(OWNER, "req-bad")
        assert bad.status == "failed" and bad.category == types.RequestErrorCategory.User
        pending = svc.retrieve(OWNER, "req-pending")  # the old server died with it in flight
        assert pending.status == "failed" and "restarted" in pending.error
    finally:
        svc.close()


def test_db_cli_upgrade_and_current(database_url, engine, capsys):
    assert ember_main(["db", "current", "--database-url", database_url]) == 0
    assert capsys.readouterr().out.split() == ["current", "None", "head", "0004"]
    assert ember_main(["db", "upgrade", "--database-url", database_url, "--revision", "0001"]) == 0
    assert "revision 0001" in capsys.readouterr().out
    assert ember_main(["db", "upgrade", "--database-url", database_url]) == 0
    assert "revision 0004" in capsys.readouterr().out
    assert set(inspect(engine).get_table_names()) >= {"alembic_version", "sessions", "futures"}
    with engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == "0004"


def test_db_cli_data_dir_is_the_servers_sqlite_file(tmp_path, capsys):
    assert ember_main(["db", "upgrade", "--data-dir", str(tmp_path / "d")]) == 0
    assert "revision 0004" in capsys.readouterr().out
    assert (tmp_path / "d" / "ember.db").is_file()


def test_a_database_from_a_newer_ember_is_refused_with_the_reason(engine):
    migrations.upgrade(engine)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '0099'"))
    with pytest.raises(RuntimeError, match="revision 0099, which this ember does not know"):
        migrations.upgrade(engine)
