"""What a client is told about an infrastructure fault, and which faults are worth a retry.

A client gets a short, categorised message (`server`); the server log keeps the
traceback. Raw SQL, driver "background" links and file paths never reach a client:
SQLAlchemy's `str(exc)` carries the statement (`[SQL: UPDATE futures ...]`) and an
`OSError` carries the path it failed on, so both are reduced to their cause here.
"""

from __future__ import annotations

import errno
import os

from sqlalchemy.exc import DBAPIError, OperationalError, SQLAlchemyError

MAX_DETAIL = 200


class StoreBusy(Exception):
    """This process could not get its turn to write to the database in time."""


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:MAX_DETAIL]


def _db_cause(exc: SQLAlchemyError) -> str:
    orig = getattr(exc, "orig", None)
    if orig is not None:
        return _first_line(str(orig)) or type(orig).__name__
    return type(exc).__name__  # no driver error: the SQLAlchemy text is ours and may hold SQL


def public_message(exc: BaseException) -> str:
    """A one-line description of `exc` safe to send to any client."""
    if isinstance(exc, StoreBusy):
        return f"database unavailable: {exc}"
    if isinstance(exc, SQLAlchemyError):
        return f"database error: {_db_cause(exc)}"
    if isinstance(exc, OSError):
        cause = os.strerror(exc.errno) if exc.errno else type(exc).__name__
        return f"storage error: {cause}"
    return f"internal error ({type(exc).__name__}): {_first_line(str(exc))}"


def is_transient(exc: BaseException) -> bool:
    """Faults that may clear by themselves (a lock released, space freed, a connection back)."""
    if isinstance(exc, (StoreBusy, OperationalError)):
        return True
    if isinstance(exc, DBAPIError):
        return bool(exc.connection_invalidated)
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EAGAIN)
