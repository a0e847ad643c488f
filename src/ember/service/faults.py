"""What a client is told about an infrastructure fault, and which faults are worth a retry.

A client gets a short, categorised message (`server`); the server log keeps the
traceback. Raw SQL, driver "background" links and file paths never reach a client:
SQLAlchemy's `str(exc)` carries the statement (`[SQL: UPDATE futures ...]`) and an
`OSError` carries the path it failed on, so both are reduced to their cause here; any
other message has its absolute paths replaced by `<path>`. Running out of memory
(MemoryError, torch's "unable to mmap ... from file <path>", CUDA OOM) is one fixed
message saying so, whatever the allocator printed.
"""

from __future__ import annotations

import errno
import os
import re

from sqlalchemy.exc import DBAPIError, OperationalError, SQLAlchemyError

MAX_DETAIL = 200
# What allocators say when memory runs out (torch's CPU allocator, its mmap of safetensors,
# CUDA, C++), matched in the message: they raise RuntimeError, not MemoryError.
_OOM_TEXT = ("out of memory", "unable to mmap", "cannot allocate memory", "can't allocate memory",
             "bad_alloc", "failed to allocate")
OUT_OF_MEMORY = ("out of memory: the server could not allocate the memory this request needs ({kind}); retry "
                 "later, or free memory this API key holds (close ServiceClients you no longer use: their "
                 "training runs are unloaded and their sampling sessions released)")
# An absolute server path inside a message (`/data/models/x/model.safetensors`); not the
# path part of a URL or tinker:// path (preceded by ':' or '/').
_PATH = re.compile(r"(?<![\w.:/])(?:/[^\s'\"<>:,;()\[\]/]+){2,}/?")


class StoreBusy(Exception):
    """This process could not get its turn to write to the database in time."""


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return _PATH.sub("<path>", line)[:MAX_DETAIL]


def is_out_of_memory(exc: BaseException) -> bool:
    """MemoryError, torch's OutOfMemoryError (CUDA), ENOMEM, or an allocator's message."""
    if isinstance(exc, MemoryError) or any(c.__name__ == "OutOfMemoryError" for c in type(exc).__mro__):
        return True
    if isinstance(exc, OSError) and exc.errno == errno.ENOMEM:
        return True
    text = str(exc).lower()
    return any(t in text for t in _OOM_TEXT)


def _db_cause(exc: SQLAlchemyError) -> str:
    orig = getattr(exc, "orig", None)
    if orig is not None:
        return _first_line(str(orig)) or type(orig).__name__
    return type(exc).__name__  # no driver error: the SQLAlchemy text is ours and may hold SQL


def public_message(exc: BaseException) -> str:
    """A one-line description of `exc` safe to send to any client (no server paths)."""
    if is_out_of_memory(exc):
        return OUT_OF_MEMORY.format(kind=type(exc).__name__)
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
