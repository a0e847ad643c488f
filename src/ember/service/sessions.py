"""Sessions: one per client, owner of its training runs and sampling sessions.

A session ends when its client finishes it, when its heartbeats stop for
`sessions.heartbeat_timeout_s` (the client is gone), or when it is idle for `sessions.idle_ttl_s`: no
request named it, one of its training runs or one of its sampling sessions, and no
future of it was pending, for that long. Heartbeats alone do not keep a session alive
(the SDK sends them from a background thread for as long as the client object lives, so
a forgotten client would otherwise hold its runs' memory for ever). An expired session's
runs are saved (`tinker://<run>/weights/session-end`) and unloaded, a finished one's only
unloaded, and its samplers released (`Service._on_session_end`); its next request is told
why (410), a training call naming the saved checkpoint.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from tinker import types

from ember.service.api import NotFoundError, SessionGoneError, UserError
from ember.service.clock import SYSTEM_CLOCK, Clock
from ember.service.quotas import check_sessions
from ember.service.store import SessionRow, Store

log = logging.getLogger(__name__)

FINISH_REASONS = ("success", "errored", "interrupted")


def session_of(resource_id: object) -> str | None:
    """The session a training run or sampling session id belongs to
    (`<session>:train:<n>`, `<session>:sample:<n>`); None for anything else."""
    if not isinstance(resource_id, str) or ":" not in resource_id:
        return None
    return resource_id.split(":", 1)[0] or None


class SessionManager:
    def __init__(self, store: Store, timeout_s: float | None, on_expire: Callable[[str], None],
                 idle_ttl_s: float | None = None, max_per_key: int | None = None,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self._store = store
        self._clock = clock  # wall-clock seconds; tests pass a manual clock to drive expiry
        self._timeout_s = timeout_s
        self._on_expire = on_expire
        self._idle_ttl_s = idle_ttl_s
        self._max_per_key = max_per_key
        self._active: dict[str, float] = {}  # session id -> time of its last request (this lifetime)
        self._started = self._clock()

    def touch(self, session_id: str | None) -> None:
        """A request (or a finished future) of `session_id`: it is not idle now. Only
        sessions already tracked are (an id from a request may name nothing: the map stays
        bounded by the active sessions)."""
        if session_id in self._active:
            self._active[session_id] = self._clock()

    def create(
        self,
        owner: str,
        tags: Sequence[str] = (),
        user_metadata: Mapping[str, Any] | None = None,
        project_id: str | None = None,
        display_name: str | None = None,
        sdk_version: str | None = None,
    ) -> types.CreateSessionResponse:
        if self._max_per_key is not None:
            check_sessions(self._store.count_active_sessions(owner), self._max_per_key, self._idle_ttl_s,
                           self._timeout_s)
        now = self._clock()
        sid = f"sess-{uuid.uuid4().hex[:20]}"
        self._active[sid] = now
        self._store.add(
            SessionRow(
                id=sid, owner=owner, tags=[str(t) for t in tags], user_metadata=dict(user_metadata or {}),
                project_id=project_id, display_name=display_name, sdk_version=sdk_version,
                status="active", created_at=now, last_heartbeat=now,
            )
        )
        return types.CreateSessionResponse(session_id=sid)

    def row(self, owner: str, session_id: str) -> SessionRow:
        row = self._store.get(SessionRow, session_id)
        if row is None or row.owner != owner:
            raise NotFoundError(f"unknown session {session_id!r}")
        return row

    def require_active(self, owner: str, session_id: str) -> SessionRow:
        row = self.row(owner, session_id)
        if row.status != "active":
            why = f" ({row.finish_detail})" if row.status == "expired" and row.finish_detail else ""
            raise SessionGoneError(f"session {session_id} is {row.status}{why}; start a new ServiceClient")
        return row

    def heartbeat(self, owner: str, session_id: str) -> None:
        self.require_active(owner, session_id)
        self._store.update(SessionRow, session_id, last_heartbeat=self._clock())

    def finish(self, owner: str, session_id: str, reason: str = "success", detail: str | None = None) -> bool:
        """Mark the session finished; False if it already was (first finish wins)."""
        row = self.row(owner, session_id)
        if reason not in FINISH_REASONS:
            raise UserError(f"finish reason must be one of {FINISH_REASONS}, got {reason!r}")
        if row.status != "active":
            return False
        self._store.update(SessionRow, session_id, status="finished", finish_reason=reason, finish_detail=detail)
        self._active.pop(session_id, None)
        return True

    def expire(self, busy: Collection[str] = ()) -> list[str]:
        """End sessions without a heartbeat for `timeout_s`, and those idle for
        `idle_ttl_s` that are not in `busy` (sessions with pending work); their ids."""
        ended: list[str] = []
        if self._timeout_s is not None:
            for row in self._store.stale_sessions(self._clock() - self._timeout_s):
                self._end(row.id, f"no heartbeat for more than {self._timeout_s:g} s")
                ended.append(row.id)
        if self._idle_ttl_s is not None:
            for sid in self._idle(busy):
                if sid not in ended:
                    self._end(sid, f"idle for more than {self._idle_ttl_s:g} s: sessions.idle_ttl_s")
                    ended.append(sid)
        return ended

    def _idle(self, busy: Collection[str]) -> list[str]:
        now = self._clock()
        idle = []
        for row in self._store.active_sessions():
            # a session of an earlier lifetime is tracked from this one's start
            last = self._active.setdefault(row.id, max(row.created_at, self._started))
            if now - last > self._idle_ttl_s and row.id not in busy:
                idle.append(row.id)
        return idle

    def _end(self, session_id: str, why: str) -> None:
        self._store.update(SessionRow, session_id, status="expired", finish_detail=why)
        self._active.pop(session_id, None)
        log.info("session %s expired (%s)", session_id, why)
        self._on_expire(session_id)

    def get(self, owner: str, session_id: str) -> types.GetSessionResponse:
        row = self.row(owner, session_id)
        runs = self._store.run_ids_of_session(session_id)
        samplers = self._store.sampler_ids_of_session(session_id)
        meta = {str(k): str(v) for k, v in (row.user_metadata or {}).items()} or None
        return types.GetSessionResponse(
            training_run_ids=list(runs), sampler_ids=list(samplers), user_metadata=meta, display_name=row.display_name
        )

    def list(self, owner: str, limit: int, offset: int) -> types.ListSessionsResponse:
        return types.ListSessionsResponse(sessions=self._store.list_session_ids(owner, limit, offset))
