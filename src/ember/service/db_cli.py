"""`ember db upgrade|current`: the service database's schema migrations, by hand.

`ember serve` (and any `Service`) upgrades its database at start-up anyway; this is for
operators who migrate before rolling out, or want to see where a database stands.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["upgrade", "current"],
                        help="upgrade: migrate to the newest schema; current: print the revision and the head")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--data-dir", help="the server's data directory (its SQLite file ember.db)")
    where.add_argument("--database-url", help="a SQLAlchemy URL, e.g. postgresql+psycopg://user@host/db")
    parser.add_argument("--revision", default="head", help="upgrade to this revision (default: head)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ember.service import migrations
    from ember.service.store import default_database_url, make_engine

    if args.data_dir is not None:
        Path(args.data_dir).mkdir(parents=True, exist_ok=True)
    url = args.database_url or default_database_url(args.data_dir)
    engine = make_engine(url)
    try:
        if args.action == "upgrade":
            print(f"database at revision {migrations.upgrade(engine, args.revision)} (head {migrations.head()})")
        else:
            with engine.connect() as conn:
                print(f"current {migrations.current(conn)} head {migrations.head()}")
    finally:
        engine.dispose()
    return 0
