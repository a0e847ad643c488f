"""An environment variable set for a moment in this process (while a library reads it),
then the caller's value back: the one place that does so (vLLM's engine start, a
weight-sync NCCL group's construction).

The environment is the process's, so each caller passes the lock that orders its own
moments; they are separate locks so that a long vLLM start never holds up an NCCL group.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def scoped_env(lock: threading.Lock, name: str, value: str | Callable[[str | None], str]) -> Iterator[None]:
    """`name` = `value` (or `value(the caller's value)`) inside the block, under `lock`."""
    with lock:
        before = os.environ.get(name)
        os.environ[name] = value(before) if callable(value) else value
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before
