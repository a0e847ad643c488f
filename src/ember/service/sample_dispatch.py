"""Sample dispatch: a resolved sampling session's request to its backend, and the result to its future.

`SampleDispatcher` counts each request's work against its owner (`QueuedWork`), submits it
to the backend, keeps it cancellable while it runs (`cancel`), and finishes its future on
the finisher threads: the stability record first (`record_stability_info`), then the
result. A clean stop refuses new samples (`stop_taking`) and lets the running ones finish
within the drain bound (`drain`; README "Restarts"). Part of `SamplerManager`
(`service/samplers.py`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Any

from tinker import types

from ember import failpoints
from ember.service.api import Submission, UserError
from ember.service.faults import public_message
from ember.service.futures import FutureTable, Server, User
from ember.service.limits import Limits
from ember.service.quotas import QueuedWork, request_work
from ember.service.sampler_backends import BackendCache
from ember.service.stability import StabilityRecords

# SamplerManager's logger (this module is part of it): operators filter every sampling line by one name
log = logging.getLogger("ember.service.samplers")

SAMPLE_SHUTDOWN = ("the server shut down before this sample finished (runs.shutdown_drain_s passed): sample again "
                   "once it is back; its sampling session comes back with it")
SAMPLE_STOPPING = "the server is shutting down: this sample was not accepted; submit it again once it is back"


class SampleDispatcher:
    """Submits samples to backends, tracks the running ones, and finishes their futures."""

    def __init__(self, futures: FutureTable, backends: BackendCache, limits: Limits,
                 records: StabilityRecords | None) -> None:
        self.futures, self.backends = futures, backends
        self.records = records  # where record_stability_info samples are kept (None: refused)
        self.queued = QueuedWork(limits)
        self._finisher = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="ember-sample-finish")
        self._running: dict[str, tuple[str, Any]] = {}  # request_id -> (owner, backend Future): `cancel`
        self._running_lock = threading.Lock()  # not the session table's: a sampler's creation holds that for minutes
        self.stopping = False  # a clean stop began: new samples are refused (`stop_taking`)

    def dispatch(self, sub: Submission, live: Any, version: Any, kwargs: dict[str, Any], record: bool = False,
                 follow: Any = None) -> None:
        """Submit `live`'s request (a `LiveSampler`; `version`: the weights it samples; `follow`:
        its run's in-flight `VersionFollower`, sent to a backend that adopts versions
        mid-sequence) to its base model's backend, or fail its future saying why."""
        from ember.sampling.base import SamplingRequest, submit_streaming

        rid = sub.request_id
        reserved = None
        try:
            backend = self.backends.backend(live.base)
            work = request_work(kwargs, backend.default_max_tokens)
            self.queued.reserve(live.owner, *work)
            reserved = work
            request = SamplingRequest(version=version, sequence_ids=sub.sample_sequence_ids,
                                      owner=live.owner, session=live.sampler_id,
                                      follow=follow if backend.follows_mid_sequence else None, **kwargs)
            failpoints.hit("sampler.submit")
            fut = submit_streaming(backend, request)  # `on_tokens` in kwargs: a streamed request
        except UserError as exc:  # validation refused the request: the caller's to fix
            self._release(live.owner, reserved)
            self.futures.fail(rid, str(exc), User)
            return
        except Exception as exc:  # noqa: BLE001
            self._release(live.owner, reserved)
            log.exception("sample %s could not be submitted", rid)
            self.futures.fail(rid, public_message(exc), Server)
            return
        # Finished on the finisher threads, not the sampler's: a slow database write
        # (retried while locked) must not hold up the decode step of every other request.
        keep = (live.owner, live.session_id, kwargs["prompt"]) if record else None
        with self._running_lock:
            self._running[rid] = (live.owner, fut)
        fut.add_done_callback(lambda f: self._done(rid, f, keep, live.owner, work))

    def cancel(self, owner: str, request_id: str) -> bool:
        """Give up on `owner`'s sample `request_id` (a streaming client hung up): the backend
        frees its slots at its next step (`Sampler.streams_tokens`) and the future fails.
        False when it is not running (finished, unknown, or another owner's)."""
        with self._running_lock:
            found = self._running.get(request_id)
        return found is not None and found[0] == owner and found[1].cancel()

    def _done(self, rid: str, fut, keep, owner: str, work: tuple[int, int]) -> None:
        """On the backend's thread: the owner's queued work is released at once, the rest is the finisher's."""
        with self._running_lock:
            self._running.pop(rid, None)
        self._release(owner, work)
        self._finisher.submit(self._finish, rid, fut, keep)

    def _release(self, owner: str, work: tuple[int, int] | None) -> None:
        if work is not None:
            self.queued.release(owner, *work)

    def _finish(self, rid: str, fut, keep: tuple[str, str, types.ModelInput] | None = None) -> None:
        if fut.cancelled():
            self.futures.fail(rid, "the sample was cancelled by its client", User)
            return
        exc = fut.exception()
        if exc is None and keep is not None:
            try:  # before the future completes: a client holding the sample can train on it at once
                self.records.record(*keep, fut.result())
            except Exception as rec_exc:  # noqa: BLE001 - our fault, reported as such
                log.exception("sample %s: stability records not kept", rid)
                self.futures.fail(rid, public_message(rec_exc), Server)
                return
        if exc is None:
            self.futures.complete(rid, fut.result())
        elif isinstance(exc, UserError):
            self.futures.fail(rid, str(exc), User)
        else:  # any other exception, a ValueError from torch included, is a bug of ours
            log.error("sample %s failed", rid, exc_info=exc)
            self.futures.fail(rid, public_message(exc), Server)

    # ------------------------------------------------------------------ a clean stop
    def stop_taking(self) -> None:
        """A clean stop began: every new sample is refused (category server, `SAMPLE_STOPPING`)."""
        self.stopping = True

    def drain(self, timeout_s: float) -> int:
        """Let the samples running finish for up to `timeout_s`; fail those still running then
        (category server, `SAMPLE_SHUTDOWN`: the client samples again after the restart). How
        many failed so."""
        with self._running_lock:
            running = [fut for _, fut in self._running.values()]
        concurrent.futures.wait(running, timeout=max(0.0, timeout_s))
        with self._running_lock:
            left = list(self._running)
        for rid in left:
            self.futures.fail(rid, SAMPLE_SHUTDOWN, Server)
        return len(left)

    def close(self) -> None:
        self._finisher.shutdown(wait=True)  # the samplers' last results are written
