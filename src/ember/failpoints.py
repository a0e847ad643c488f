"""Fail points: named places where a test makes ember fail on purpose, deterministically.

Crash-consistency and fault-isolation tests need a server to die or fail at an exact
point (between writing a checkpoint and committing its row, at the database write of a
future's result, ...). Timing a `kill -9` from outside cannot hit those points reliably;
a fail point can. Production code marks a point with `hit("name")`, which costs a dict
lookup when nothing is armed (the default: nothing ever is unless an operator asks).

Armed from the environment of a server process (a test starts `ember serve` with it):

    EMBER_FAILPOINTS="checkpoint.after_write=kill;futures.finish_write=dblocked*3"

or in process with `arm(name, action, times)` / `disarm()`. In process a point can also be armed
for one request: `arm(name, action, key="bob")` fires only at hits whose key (a point that
serves many requests passes one, e.g. the sequence id) contains "bob"; other hits pass uncounted.
Actions:

    kill          SIGKILL this process (a crash: nothing is flushed or cleaned up)
    raise         RuntimeError("fail point <name>")
    valueerror    ValueError as numpy raises it on mismatched shapes: a bug of ember's that must be
                  reported as `server` (not as bad input: only `UserError` is the caller's fault)
    decodeerror   UnicodeDecodeError as a tokenizer raises on a broken byte (a bug-like failure of one request)
    enospc        OSError(ENOSPC): a full disk
    dblocked      sqlalchemy OperationalError "database is locked"
    oom           MemoryError
    mmap          RuntimeError "unable to mmap ... from file <a server path>" (torch's words when
                  loading safetensors runs out of memory)
    sleep:S       sleep S seconds, then continue
    hold          block the hitting thread until `release(name)` or `disarm()` (at most
                  `HOLD_MAX_S`, then continue): a test keeps an op running for as long as it needs

`*N` fires the action on the first N hits only (default: every hit); `@K` lets the first
K-1 hits pass and fires from the K-th on (`checkpoint.after_write=kill@2`: the second save
dies, after a first one that completed), written after `*N` when both are given. The points are
listed in `POINTS`; arming an unknown name is an error, so a typo cannot make a test
pass vacuously.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from dataclasses import dataclass, field

ENV = "EMBER_FAILPOINTS"

POINTS = {
    "checkpoint.before_write": "a save has chosen its directory, nothing written yet",
    "checkpoint.after_write": "the checkpoint's files are complete, its row is not committed",
    "checkpoint.after_commit": "the row points at the new directory, the replaced one is not removed yet",
    "futures.finish_write": "the database write that finishes a future (result or error)",
    "futures.after_create": "a create call's future row is committed, its work is not queued yet",
    "sampler.decode_request": "per-request work of the shared sampling step (stop strings, outputs; key: the "
                              "sequence id of a finished sequence)",
    "sampler.score_prompt": "a request's prompt logprobs are about to be computed (key: its sequence ids)",
    "sampler.top_logprobs": "the top logprobs of decoding sequences are about to be computed, batched or per "
                            "request (key: their sequence ids; `oom` fails it naming the matrix's shape)",
    "sampler.stop_strings": "a sequence with stop strings is about to have its text decoded (once per decode step)",
    "run.create_engine": "a training run's engine is about to be built (on its lane)",
    "run.op": "a training run's op (forward_backward, optim_step, save, ...) is about to run on its lane",
    "sampler.submit": "a sample request, checked and counted against its owner, is about to reach its sampler",
}
HOLD_MAX_S = 60.0


class FailPointError(RuntimeError):
    pass


@dataclass
class _Armed:
    action: str
    remaining: int  # -1: every hit
    skip: int = 0  # hits that pass before the action fires
    key: str | None = None  # fire only at hits whose key contains this (None: every hit)
    released: threading.Event = field(default_factory=threading.Event)  # ends a `hold`


_lock = threading.Lock()
_armed: dict[str, _Armed] = {}
_env_loaded = False


def parse(spec: str) -> dict[str, _Armed]:
    """The points an `EMBER_FAILPOINTS` value arms, by name (the syntax of the module
    docstring); an unknown name or action, a missing `=` or `@0` is a ValueError."""
    out: dict[str, _Armed] = {}
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        name, sep, action = item.partition("=")
        if not sep:
            raise ValueError(f"{ENV}: expected name=action, got {item!r}")
        action, _, first = action.partition("@")
        action, _, times = action.partition("*")
        skip = int(first) - 1 if first else 0
        if skip < 0:
            raise ValueError(f"{ENV}: @K counts hits from 1, got {item!r}")
        out[_check(name.strip())] = _Armed(_check_action(action.strip()), int(times) if times else -1, skip)
    return out


def _check(name: str) -> str:
    if name not in POINTS:
        raise ValueError(f"unknown fail point {name!r}; known: {sorted(POINTS)}")
    return name


def _check_action(action: str) -> str:
    kind, _, arg = action.partition(":")
    if kind not in ("kill", "raise", "enospc", "dblocked", "sleep", "oom", "mmap", "hold", "valueerror",
                    "decodeerror") or (kind == "sleep") != bool(arg):
        raise ValueError(f"unknown fail point action {action!r}")
    if arg:
        float(arg)
    return action


def _load_env() -> None:
    global _env_loaded
    with _lock:
        if not _env_loaded:
            _armed.update(parse(os.environ.get(ENV, "")))
            _env_loaded = True


def arm(name: str, action: str, times: int = -1, skip: int = 0, key: str | None = None) -> None:
    """Arm `name` in this process (a test, or an operator's drill): after `skip` hits pass,
    `times` hits, or every hit if -1; with `key`, only the hits whose key contains it count
    (one request's, of a shared point)."""
    _load_env()
    with _lock:
        _armed[_check(name)] = _Armed(_check_action(action), times, skip, key)


def disarm(name: str | None = None) -> None:
    """Disarm one point, or every point."""
    _load_env()
    with _lock:
        gone = list(_armed.values()) if name is None else [p for p in [_armed.get(name)] if p is not None]
        if name is None:
            _armed.clear()
        else:
            _armed.pop(name, None)
    for point in gone:  # a thread held at a point disarmed goes on
        point.released.set()


def release(name: str) -> None:
    """Let every thread held at `name` (action `hold`) go on, and disarm it (an unknown
    name is an error, as for `arm`)."""
    disarm(_check(name))


def pending(name: str) -> bool:
    """Whether `name` is armed with hits still to fire (a test waits on it to know that a
    `hold` has caught its thread)."""
    _load_env()
    with _lock:
        armed = _armed.get(_check(name))
        return armed is not None and armed.remaining != 0


def hit(name: str, key: str | None = None) -> None:
    """Mark fail point `name`; does nothing unless it is armed (for `key`, when armed with one)."""
    if not _env_loaded:
        _load_env()
    if not _armed:
        return
    with _lock:
        armed = _armed.get(name)
        if armed is None or armed.remaining == 0 or (armed.key is not None and armed.key not in (key or "")):
            return
        if armed.skip > 0:
            armed.skip -= 1
            return
        if armed.remaining > 0:
            armed.remaining -= 1
        action = armed.action
    if action == "hold":
        armed.released.wait(HOLD_MAX_S)
        return
    _fire(name, action)


def _fire(name: str, action: str) -> None:
    kind, _, arg = action.partition(":")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # never returns: the signal is delivered first
    if kind == "sleep":
        time.sleep(float(arg))
        return
    if kind == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if kind == "dblocked":
        from sqlalchemy.exc import OperationalError

        raise OperationalError(f"/* fail point {name} */ UPDATE futures SET ...", {}, Exception("database is locked"))
    if kind == "oom":
        raise MemoryError()
    if kind == "decodeerror":
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, f"broken byte (fail point {name})")
    if kind == "valueerror":
        raise ValueError(f"operands could not be broadcast together with shapes (3,) (4,) (fail point {name})")
    if kind == "mmap":
        path = os.path.join(os.getcwd(), "models", "tiny", "model.safetensors")
        raise RuntimeError(f"unable to mmap 342000 bytes from file <{path}>: Cannot allocate memory (12)")
    raise FailPointError(f"fail point {name}")
