"""`ClientContext`: what a sub-client needs from the `ServiceClient` that made it.

Training, sampling and REST clients get this small object instead of reaching into the
ServiceClient's private attributes: the service, the caller's identity, the session
(created on first use), the callback thread and the tokenizer cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor
from concurrent.futures import Future as ConcurrentFuture
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ember.service.api import BusyError, ServiceAPI

if TYPE_CHECKING:
    from ember.client.sampling import SamplingClient

BUSY_RETRY_S = 300.0  # how long a submission the service is too busy for is retried (the SDK retries 429 as long)


def retry_busy(submit: Callable[[], Any], give_up_s: float = BUSY_RETRY_S) -> Any:
    """`submit()`, again after `BusyError.retry_after_s` while the service raises
    `BusyError` (what the SDK does with HTTP 429), for at most `give_up_s`; then the error."""
    deadline = time.monotonic() + give_up_s
    while True:
        try:
            return submit()
        except BusyError as exc:
            if time.monotonic() + exc.retry_after_s > deadline:
                raise
            time.sleep(exc.retry_after_s)


@dataclass(frozen=True)
class ClientContext:
    """service: the `ServiceAPI` every call goes to; owner: the caller's identity in it.
    session_id(): this client's session id (created on first call).
    next_sampling_seq(): the next sampling-session sequence number of that session.
    callbacks: the thread that runs user code (custom losses), never a service lane.
    tokenizer(model_name, tokenizer_id): a tokenizer from the local model directory."""

    service: ServiceAPI
    owner: str
    session_id: Callable[[], str]
    next_sampling_seq: Callable[[], int]
    callbacks: Executor
    tokenizer: Callable[[str | None, str | None], Any]

    def watch(self, request_id: str) -> ConcurrentFuture:
        """A future of the request's final state."""
        return self.service.watch(self.owner, request_id)

    def sampling_client(self, sampling_session_id: str, base_model: str | None,
                        record_stability_info: bool = False) -> "SamplingClient":
        from ember.client.sampling import SamplingClient

        if base_model is None:
            base_model = self.service.get_sampler(self.owner, sampling_session_id).base_model
        return SamplingClient(self, sampling_session_id, base_model, record_stability_info)
