"""Futures of the in-process client: the SDK's own `APIFuture` classes over service futures.

`AwaitableConcurrentFuture` is tinker's: `.result(timeout=None)`, `await fut`,
`.result_async()`, `.future()`. A failed service future raises the SDK's
`tinker.RequestFailedError` with the same `category` as over HTTP.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from concurrent.futures import Future as ConcurrentFuture
from typing import Any, Generic, TypeVar

from tinker import RequestFailedError
from tinker.lib.public_interfaces.api_future import APIFuture, AwaitableConcurrentFuture

from ember.service.api import FutureState

T = TypeVar("T")
C = TypeVar("C")


def unwrap(state: FutureState) -> Any:
    """The result of a finished service future, or the SDK's RequestFailedError."""
    if state.status == "complete":
        return state.result
    if state.status == "failed":
        raise RequestFailedError(
            f"Request failed: {state.error} (request {state.request_id}, type {state.request_type})",
            request_id=state.request_id,
            category=state.category,
        )
    raise RuntimeError(f"future {state.request_id} is still pending")


def chain(src: ConcurrentFuture, fn: Callable[[Any], Any]) -> ConcurrentFuture:
    """A future resolving to fn(src.result()) (or to the exception of either)."""
    out: ConcurrentFuture = ConcurrentFuture()

    def done(f: ConcurrentFuture) -> None:
        if out.done():
            return
        try:
            out.set_result(fn(f.result()))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            out.set_exception(exc)

    src.add_done_callback(done)
    return out


def completed(value: Any) -> AwaitableConcurrentFuture:
    f: ConcurrentFuture = ConcurrentFuture()
    f.set_result(value)
    return AwaitableConcurrentFuture(f)


def failed(exc: BaseException) -> AwaitableConcurrentFuture:
    f: ConcurrentFuture = ConcurrentFuture()
    f.set_exception(exc)
    return AwaitableConcurrentFuture(f)


class ClientFuture(APIFuture[C], Generic[C]):
    """A future of a client that can also be used directly as the client.

    The SDK's `create_*_client` methods return such a future (`BackcompatTrainingClientFuture`):
    `.result()` / `await` give the client, and calling client methods on the future itself
    still works (deprecated in the SDK, with a FutureWarning; the same here).
    """

    def __init__(self, future: ConcurrentFuture) -> None:
        self._future = future

    def result(self, timeout: float | None = None) -> C:
        return self._future.result(timeout)

    async def result_async(self, timeout: float | None = None) -> C:
        return await AwaitableConcurrentFuture(self._future).result_async(timeout)

    def future(self) -> ConcurrentFuture:
        return self._future

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        warnings.warn(
            f"Using the future as the client (`.{name}`) is deprecated; call .result() on it, or await it, "
            "to get the client first",
            FutureWarning,
            stacklevel=2,
        )
        return getattr(self.result(), name)

    def __repr__(self) -> str:
        f = self._future
        state = "pending" if not f.done() else (f"failed: {f.exception()!r}" if f.exception() else repr(f.result()))
        return f"<{type(self).__name__}: {state}>"
