"""`WeightGate`: one set of base weights in an inference engine, many versions waiting.

An engine such as vLLM holds one full set of weights at a time. Requests name the set
they need (a key: the base model's own, or one full fine-tuning version); the gate lets
requests for the loaded set run together, and switches sets only when none is running:
drain, load, resume. Requests are admitted in arrival order — a request for the loaded
set does not overtake one already waiting for another set — so no version starves.

Runs on one asyncio event loop (not thread-safe; the sampler's loop thread owns it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable

Loader = Callable[[str], Awaitable[None]]


class WeightGate:
    def __init__(self, loaded: str) -> None:
        self.loaded = loaded
        self.active = 0  # requests running on the loaded set
        self.swaps = 0  # completed loads (`VLLMSampler.debug_state` reports them)
        self._waiting: deque[tuple[str, Loader, asyncio.Future]] = deque()
        self._swapping = False

    def reset(self, loaded: str) -> None:
        """The engine was rebuilt: it holds `loaded`; waiting requests are re-admitted."""
        self.loaded, self._swapping = loaded, False
        self._pump()

    @contextlib.asynccontextmanager
    async def hold(self, key: str, load: Loader):
        """Run the body while the engine holds `key` (loading it with `load` when its turn comes)."""
        if key == self.loaded and not self._waiting and not self._swapping:
            self.active += 1
        else:
            fut = asyncio.get_running_loop().create_future()
            self._waiting.append((key, load, fut))
            self._pump()
            try:
                await fut
            except BaseException:
                self._forget(fut)
                raise
        try:
            yield
        finally:
            self.active -= 1
            self._pump()

    def _forget(self, fut: asyncio.Future) -> None:
        """A waiter was cancelled: drop it, or give back the slot it was just granted."""
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            self.active -= 1
        self._waiting = deque(w for w in self._waiting if w[2] is not fut)
        self._pump()

    def _pump(self) -> None:
        while self._waiting and not self._swapping:
            key, load, fut = self._waiting[0]
            if fut.done():  # cancelled while waiting
                self._waiting.popleft()
                continue
            if key == self.loaded:
                self._waiting.popleft()
                self.active += 1
                fut.set_result(None)
                continue
            if self.active == 0:
                self._swapping = True
                asyncio.get_running_loop().create_task(self._swap(key, load))
            return

    async def _swap(self, key: str, load: Loader) -> None:
        try:
            await load(key)
        except Exception as exc:  # noqa: BLE001 - the waiters for this set fail with it
            self._swapping = False
            self._fail_waiters(key, exc)
        else:
            self.loaded, self._swapping = key, False
            self.swaps += 1
        self._pump()

    def _fail_waiters(self, key: str, exc: Exception) -> None:
        keep = deque()
        for w in self._waiting:
            if w[0] == key and not w[2].done():
                w[2].set_exception(exc)
            elif not w[2].done():
                keep.append(w)
        self._waiting = keep
