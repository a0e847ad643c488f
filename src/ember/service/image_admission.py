"""Image decoding bounded across requests: a server-wide budget of decoded pixels in
flight, fair shares of it per API key, and one small pool of decoding threads
(docs/architecture.md, "Trust boundaries").

`service/images.py` checks every image's header of a request (format, declared size,
the request's pixel total) before any is decoded; what it then decodes goes through
`ImageAdmission`:

* at most `Limits.max_image_requests_per_key` requests of one key have their images
  checked at once (`request`, taken before any header is read); one more is refused at
  once with `BusyError` (HTTP 429, retried by the SDK), so one tenant's flood holds a few
  of the server's request threads, never all of them, and a refusal costs no image work;
* each image holds its pixels of the budget (`Limits.max_decoding_image_pixels`) while it
  is decoded (`decode`). A key holding pixels may take more only within its fair share (the budget
  divided among the keys with requests in here); over it, the request waits for its own
  key's images to finish, and after `wait_s` is refused with `BusyError`. Another key's
  request is granted as soon as the budget has room, so a flood slows its own sender;
* the decoding runs on `Limits.max_image_decode_threads` threads made when the service
  starts (none is started per request, so memory pressure cannot fail a thread start),
  each at a nice value `DECODE_NICE` above the server's on Linux (where every thread has
  its own): decoding is background work, and the scheduler gives a core to the samplers,
  trainers and the event loop first, so another tenant's requests keep their latency;
* a `MemoryError` while decoding fails that request with `BusyError` (retry later), and
  the pixels are dropped before the error leaves, so the next request has the memory.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ember.service.api import BusyError
from ember.service.limits import Limits

ADMISSION_WAIT_S = 30.0  # a request's wait for its key's share, well inside the SDK's timeouts
DECODE_NICE = 10  # CFS weighs a nice-10 thread at ~1/10 of a nice-0 one


class PixelBudget:
    """Decoded pixels in flight, shared fairly among the keys that have requests in."""

    def __init__(self, total: int, max_requests_per_key: int, wait_s: float = ADMISSION_WAIT_S):
        self.total, self.max_requests_per_key, self.wait_s = total, max_requests_per_key, wait_s
        self._cond = threading.Condition()
        self._used = 0
        self._held: Counter[str] = Counter()  # owner -> pixels granted now
        self._requests: Counter[str] = Counter()  # owner -> requests inside `request`

    @contextmanager
    def request(self, owner: str) -> Iterator[None]:
        """One request of `owner` in admission (BusyError beyond the per-key bound)."""
        with self._cond:
            if self._requests[owner] >= self.max_requests_per_key:
                raise BusyError(f"this API key already has {self._requests[owner]} requests having their images "
                                f"checked (limits.max_image_requests_per_key={self.max_requests_per_key}); retry")
            self._requests[owner] += 1
        try:
            yield
        finally:
            with self._cond:
                self._requests[owner] -= 1
                if not self._requests[owner]:
                    del self._requests[owner]
                self._cond.notify_all()  # one key fewer: the others' shares grew

    @contextmanager
    def pixels(self, owner: str, n: int, what: str) -> Iterator[None]:
        """Hold `n` pixels of the budget for `owner` (waits for its share; BusyError after `wait_s`)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._grantable(owner, n), self.wait_s):
                raise BusyError(f"{what}: the server is decoding other images ({self._used} of "
                                f"limits.max_decoding_image_pixels={self.total} pixels in flight, {self._held[owner]} "
                                f"of them this key's); retry")
            self._used += n
            self._held[owner] += n
        try:
            yield
        finally:
            with self._cond:
                self._used -= n
                self._held[owner] -= n
                if not self._held[owner]:
                    del self._held[owner]
                self._cond.notify_all()

    def share(self) -> int:
        """Each key's fair share now: the budget over the keys with requests in."""
        return self.total // max(1, len(self._requests))

    def _grantable(self, owner: str, n: int) -> bool:
        if self._used + n > self.total:
            return False
        held = self._held[owner]
        return held == 0 or held + n <= self.share()  # a key with nothing in flight always gets its turn

    def in_flight(self) -> dict[str, int]:
        """Read-only: pixels held per key now (for metrics and tests)."""
        with self._cond:
            return dict(self._held)


class DecodePool:
    """`threads` daemon threads, started here, that run decode jobs in arrival order."""

    def __init__(self, threads: int, name: str = "ember-image-decode"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def run(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on a pool thread; its result, or its exception raised here."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:  # every job is queued before `close`'s stop marks, so a worker runs it
            if self._closed:
                raise BusyError("the server is shutting down; retry")
            self._jobs.put((fn, future))
        return future.result()

    def _work(self) -> None:
        background_priority()
        while (item := self._jobs.get()) is not None:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting request
                    future.set_exception(exc)
            del item, fn, future  # nothing of the job outlives it on this thread

    def close(self) -> None:
        """The threads end once the jobs queued so far are done; `run` refuses new ones."""
        with self._lock:
            self._closed = True
            for _ in self._threads:
                self._jobs.put(None)


class ImageAdmission:
    """The budget and the pool of one service (`Service` makes it from its `Limits`)."""

    def __init__(self, limits: Limits, wait_s: float = ADMISSION_WAIT_S):
        self.budget = PixelBudget(limits.max_decoding_image_pixels, limits.max_image_requests_per_key, wait_s)
        self.pool = DecodePool(limits.max_image_decode_threads)

    def request(self, owner: str):
        """A context holding one of `owner`'s `max_image_requests_per_key` places (BusyError
        when none is free), taken before a request's headers are read: a refusal costs no
        image work."""
        return self.budget.request(owner)

    def decode(self, owner: str, jobs: Sequence[tuple[int, str, Callable[[], Any]]]) -> list[Any]:
        """Each `(pixels, where, decode)` of one request of `owner`, one after another, on
        the pool under the budget; their results. A decoder's `MemoryError` is `BusyError`."""
        out = []
        for pixels, where, decode in jobs:
            with self.budget.pixels(owner, pixels, where):
                out.append(self.pool.run(lambda: without_memory_error(decode, where)))
        return out

    def close(self) -> None:
        self.pool.close()


def background_priority(nice: int = DECODE_NICE) -> None:
    """Lower the calling thread's scheduling priority by `nice` (Linux, where
    `setpriority` on a thread id changes that thread alone; elsewhere it would change the
    whole process, so nothing is done). A thread may always lower its own priority."""
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        pass  # a sandbox that forbids it: decoding keeps the server's priority


def without_memory_error(fn: Callable[[], Any], where: str) -> Any:
    """`fn()`, its `MemoryError` turned into `BusyError` once the failed frames (and the
    pixels they held) are gone: raised inside the `except`, the new error would keep them."""
    try:
        return fn()
    except MemoryError:
        pass
    raise BusyError(f"{where}: the server ran out of memory decoding this image; retry later")
