"""A throwaway PostgreSQL server for tests and benchmarks: `initdb` into a temp directory,
Unix socket only (no TCP port to collide on), trust authentication, durability off.

    server = PostgresServer.start(find_bindir())
    url = server.create_database("t1")     # postgresql+psycopg://postgres@/t1?host=<socket dir>
    ...
    server.stop()

`initdb` and `postgres` refuse to run as root (containers, CI): then the cluster is owned
by and run as an unprivileged account (`postgres` if it exists, else `nobody`).
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SUPERUSER = "postgres"


def find_bindir() -> Path | None:
    """Where `initdb`/`pg_ctl` are: $EMBER_PG_BINDIR, `pg_ctl` on PATH, or the newest
    /usr/lib/postgresql/<version>/bin (Debian/Ubuntu keep them off PATH)."""
    env = os.environ.get("EMBER_PG_BINDIR")
    candidates = [Path(env)] if env else []
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    newest_first = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: [int(x) for x in re.findall(r"\d+", d)],
                          reverse=True)
    candidates += [Path(d) for d in newest_first]
    for d in candidates:
        if (d / "initdb").is_file() and (d / "pg_ctl").is_file():
            return d
    return None


def _run_as() -> pwd.struct_passwd | None:
    """The account to own the cluster when we are root (None: ourselves)."""
    if os.geteuid() != 0:
        return None
    for name in (SUPERUSER, "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError("running as root and neither a 'postgres' nor a 'nobody' account exists to run PostgreSQL")


@dataclass
class PostgresServer:
    bindir: Path
    root: Path
    account: pwd.struct_passwd | None

    @property
    def socket_dir(self) -> Path:
        return self.root / "sock"

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def log_path(self) -> Path:
        return self.root / "postgres.log"

    def _run(self, *cmd: str) -> None:
        ids = {} if self.account is None else {"user": self.account.pw_uid, "group": self.account.pw_gid,
                                               "extra_groups": []}
        env = dict(os.environ, LC_ALL="C", LANG="C")
        subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=self.root, **ids)

    @classmethod
    def start(cls, bindir: Path) -> "PostgresServer":
        # Short path: a Unix socket path must stay under ~100 bytes.
        root = Path(tempfile.mkdtemp(prefix="ember-pg-"))
        server = cls(bindir, root, _run_as())
        server.socket_dir.mkdir()
        if server.account is not None:
            for p in (root, server.socket_dir):
                os.chown(p, server.account.pw_uid, server.account.pw_gid)
        try:
            server._init_and_start()
        except subprocess.CalledProcessError as exc:
            log = server.log_path.read_text()[-2000:] if server.log_path.exists() else ""
            server.stop()
            raise RuntimeError(f"PostgreSQL failed to start: {exc.cmd}: {exc.stderr}\n{log}") from exc
        return server

    def _init_and_start(self) -> None:
        self._run(str(self.bindir / "initdb"), "-D", str(self.data_dir), "-U", SUPERUSER, "--auth=trust",
                  "-E", "UTF8", "--no-locale", "--no-sync")
        # fsync off: a test cluster that dies is thrown away, and it makes commits ~free.
        opts = (f"-c listen_addresses='' -k {self.socket_dir} -c fsync=off -c synchronous_commit=off "
                "-c full_page_writes=off -c max_connections=300")
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data_dir), "-l", str(self.log_path), "-w",
                  "-t", "60", "-o", opts, "start")

    def url(self, dbname: str) -> str:
        return f"postgresql+psycopg://{SUPERUSER}@/{dbname}?host={self.socket_dir}"

    def _admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(host=str(self.socket_dir), user=SUPERUSER, dbname="postgres", autocommit=True) as conn:
            conn.execute(sql)

    def create_database(self, name: str) -> str:
        """A new empty database; returns its SQLAlchemy URL."""
        if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
            raise ValueError(f"database name must be a plain identifier, got {name!r}")
        self._admin(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        # FORCE: a connection pool a test did not close must not keep the database alive.
        self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def stop(self) -> None:
        if (self.data_dir / "postmaster.pid").exists():
            try:
                self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data_dir), "-m", "immediate", "-w", "stop")
            except subprocess.CalledProcessError:
                pass  # already gone: nothing to stop
        shutil.rmtree(self.root, ignore_errors=True)
