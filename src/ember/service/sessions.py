"""Sessions: one per client, owner of its training runs and sampling sessions."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tinker import types

from ember.service.api import NotFoundError, SessionGoneError, UserError
from ember.service.store import SessionRow, Store

log = logging.getLogger(__name__)

FINISH_REASONS = ("success", "errored", "interrupted")


class SessionManager:
    def __init__(self, store: Store, timeout_s: float | None, on_expire: Callable[[str], None]) -> None:
        self._store = store
        self._timeout_s = timeout_s
        self._on_expire = on_expire

    def create(
        self,
        owner: str,
        tags: Sequence[str] = (),
        user_metadata: Mapping[str, Any] | None = None,
        project_id: str | None = None,
        display_name: str | None = None,
        sdk_version: str | None = None,
    ) -> types.CreateSessionResponse:
        now = time.time()
        sid = f"sess-{uuid.uuid4().hex[:20]}"
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
            raise SessionGoneError(f"session {session_id} is {row.status}; start a new ServiceClient")
        return row

    def heartbeat(self, owner: str, session_id: str) -> None:
        self.require_active(owner, session_id)
        self._store.update(SessionRow, session_id, last_heartbeat=time.time())

    def finish(self, owner: str, session_id: str, reason: str = "success", detail: str | None = None) -> bool:
        """Mark the session finished; False if it already was (first finish wins)."""
        row = self.row(owner, session_id)
        if reason not in FINISH_REASONS:
            raise UserError(f"finish reason must be one of {FINISH_REASONS}, got {reason!r}")
        if row.status != "active":
            return False
        self._store.update(SessionRow, session_id, status="finished", finish_reason=reason, finish_detail=detail)
        return True

    def expire(self) -> list[str]:
        if self._timeout_s is None:
            return []
        cutoff = time.time() - self._timeout_s
        stale = self._store.stale_sessions(cutoff)
        for row in stale:
            self._store.update(SessionRow, row.id, status="expired")
            log.info("session %s expired (no heartbeat for %.0fs)", row.id, self._timeout_s)
            self._on_expire(row.id)
        return [r.id for r in stale]

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
