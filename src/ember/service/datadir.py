"""One process per data directory: an exclusive lock taken before the database is touched.

A second `ember serve` (or in-process `ServiceClient`) on a data directory in use would
otherwise mark the first one's in-flight work as failed at its start-up (it takes every
pending future for a leftover of a crash). The lock is an OS file lock (`filelock`:
`flock` on Unix), so the kernel drops it when the holder dies, even by `kill -9`; the
holder's pid is written beside it so the refusal can name it.
"""

from __future__ import annotations

import os
from pathlib import Path

import filelock

LOCK_FILE = "ember.lock"
PID_FILE = "ember.pid"


class DataDirInUseError(ValueError):
    """Another process holds the data directory (ValueError: a start-up error, exit 2)."""


def check_data_dir(data_dir: str | os.PathLike) -> None:
    """ValueError, naming the directory and what is wrong, when `data_dir` cannot be this
    process's data directory: not creatable, not a directory, not writable, or in use by
    another ember process. Light (no database, no model): `ember serve` asks before it
    imports anything heavy. The service takes the lock itself later."""
    path = Path(data_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ValueError(f"data directory {str(path)!r} exists and is not a directory") from None
    except OSError as exc:
        raise ValueError(f"data directory {str(path)!r} cannot be created: {exc.strerror}") from None
    if not path.is_dir():
        raise ValueError(f"data directory {str(path)!r} exists and is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"data directory {str(path)!r} is not writable by this user")
    lock = DataDirLock(path)
    lock.acquire()  # DataDirInUseError (a ValueError) names the holder's pid
    lock.release()


class DataDirLock:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self._lock = filelock.FileLock(str(self.data_dir / LOCK_FILE), timeout=0, thread_local=False)

    def acquire(self) -> None:
        try:
            self._lock.acquire(timeout=0)
        except filelock.Timeout:
            raise DataDirInUseError(
                f"data directory {str(self.data_dir)!r} is in use by another ember process "
                f"(pid {self._holder()}); stop it, or give this one another data directory"
            ) from None
        (self.data_dir / PID_FILE).write_text(f"{os.getpid()}\n")

    def _holder(self) -> str:
        try:
            return (self.data_dir / PID_FILE).read_text().strip() or "unknown"
        except OSError:
            return "unknown"

    def release(self) -> None:
        if not self._lock.is_locked:
            return
        try:
            (self.data_dir / PID_FILE).unlink(missing_ok=True)
        finally:
            self._lock.release(force=True)
