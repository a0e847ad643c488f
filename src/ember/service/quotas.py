"""Every per-key quota, its check and its refusal message, in one place.

What one API key may hold at once is bounded (`Limits`, `service/limits.py`): training
runs loaded, client sessions active, sampling sessions loaded, checkpoint bytes, samples and
sample tokens queued. Each manager counts what it holds and calls the check here, which
refuses beyond the quota with a `UserError` naming the limit and how to free it (the
messages are part of the API: clients and tests match them). Fair shares between owners
inside one shared queue are `ember/fairness.py`'s, not a quota.
"""

from __future__ import annotations

import threading
from typing import Any

from ember.service.api import UserError
from ember.service.limits import Limits, prompt_length

RUNS_QUOTA = ("training runs quota: this API key has {n} training runs loaded, the quota is "
              "limits.max_runs_per_key={quota}; free one by ending the session that holds it (close its "
              "ServiceClient) or wait for idle sessions to expire (sessions.idle_ttl_s); a killed client's "
              "session ends after sessions.heartbeat_timeout_s without a heartbeat")
SESSIONS_QUOTA = ("sessions quota: this API key has {n} sessions active, the quota is "
                  "limits.max_sessions_per_key={quota}; close ServiceClients you no longer use (their sessions "
                  "end), or wait for idle ones to expire (sessions.idle_ttl_s={ttl}; the session of a killed "
                  "client ends after sessions.heartbeat_timeout_s={heartbeat})")
SAMPLING_SESSIONS_QUOTA = ("sampling sessions quota: this API key has {n} sampling sessions loaded, the quota is "
                           "limits.max_sampling_sessions_per_key={quota}; close ServiceClients you no longer use "
                           "(their sessions' samplers are released), or wait for idle sessions to expire "
                           "(sessions.idle_ttl_s={ttl}; a killed client's session "
                           "ends after sessions.heartbeat_timeout_s={heartbeat})")
QUOTA_FREE = ("free space by deleting checkpoints (RestClient.delete_checkpoint_from_tinker_path) or "
              "saving with a ttl_seconds")
CHECKPOINT_BYTES_FULL = ("checkpoint bytes quota: this API key's checkpoints take {used} bytes, the quota is "
                         "limits.max_checkpoint_bytes_per_key={quota}; " + QUOTA_FREE)
CHECKPOINT_BYTES_OVER = ("checkpoint bytes quota: saving {path} ({size} bytes) would bring "
                         "this API key's checkpoints to {total} bytes, over the quota "
                         "limits.max_checkpoint_bytes_per_key={quota}; " + QUOTA_FREE)


def check_runs(n: int, quota: int) -> None:
    """A new training run, with `n` of the key's loaded: `limits.max_runs_per_key`."""
    if n >= quota:
        raise UserError(RUNS_QUOTA.format(n=n, quota=quota))


def check_sessions(n: int, quota: int | None, idle_ttl_s: float | None, heartbeat_timeout_s: float) -> None:
    """A new client session, with `n` of the key's active: `limits.max_sessions_per_key` (None: no quota)."""
    if quota is not None and n >= quota:
        raise UserError(SESSIONS_QUOTA.format(n=n, quota=quota, ttl=idle_ttl_s, heartbeat=heartbeat_timeout_s))


def check_sampling_sessions(n: int, quota: int, idle_ttl_s: float | None, heartbeat_timeout_s: float) -> None:
    """A new sampling session, with `n` of the key's loaded: `limits.max_sampling_sessions_per_key`."""
    if n >= quota:
        raise UserError(SAMPLING_SESSIONS_QUOTA.format(n=n, quota=quota, ttl=idle_ttl_s,
                                                       heartbeat=heartbeat_timeout_s))


def check_checkpoint_bytes(used: int, quota: int | None) -> None:
    """Before a save, with `used` bytes of the key's checkpoints: `limits.max_checkpoint_bytes_per_key`."""
    if quota is not None and used >= quota:
        raise UserError(CHECKPOINT_BYTES_FULL.format(used=used, quota=quota))


def check_checkpoint_bytes_after(path: str, size: int, total: int, quota: int | None) -> None:
    """After a save of `size` bytes at `path` (the written size is known only then), the key's
    checkpoints then taking `total` bytes."""
    if quota is not None and total > quota:
        raise UserError(CHECKPOINT_BYTES_OVER.format(path=path, size=size, total=total, quota=quota))


class QueuedWork:
    """Samples and tokens each owner has submitted and not yet finished, bounded per owner."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._by_owner: dict[str, tuple[int, int]] = {}  # owner -> (samples, tokens)

    def reserve(self, owner: str, samples: int, tokens: int) -> None:
        """Count a request's work against its owner, or refuse it (UserError naming the limit)."""
        lim = self.limits
        with self._lock:
            have_samples, have_tokens = self._by_owner.get(owner, (0, 0))
            if have_samples + samples > lim.max_queued_samples_per_key:
                raise UserError(f"this key has {have_samples} samples queued or running; {samples} more would pass "
                                f"the limit max_queued_samples_per_key={lim.max_queued_samples_per_key}: wait "
                                "for earlier samples to finish")
            if have_tokens + tokens > lim.max_queued_sample_tokens_per_key:
                raise UserError(f"this key has {have_tokens} sample tokens (samples x (prompt + max_tokens)) queued "
                                f"or running; {tokens} more would pass the limit max_queued_sample_tokens_per_key="
                                f"{lim.max_queued_sample_tokens_per_key}: wait for earlier samples to finish")
            self._by_owner[owner] = (have_samples + samples, have_tokens + tokens)

    def release(self, owner: str, samples: int, tokens: int) -> None:
        with self._lock:
            have_samples, have_tokens = self._by_owner.get(owner, (0, 0))
            left = (have_samples - samples, have_tokens - tokens)
            if left[0] > 0:
                self._by_owner[owner] = left
            else:
                self._by_owner.pop(owner, None)

    def of(self, owner: str) -> tuple[int, int]:
        with self._lock:
            return self._by_owner.get(owner, (0, 0))

    def total(self) -> tuple[int, int]:
        """(samples, tokens) queued or running, over every owner."""
        with self._lock:
            return sum(s for s, _ in self._by_owner.values()), sum(t for _, t in self._by_owner.values())


def request_work(kwargs: dict[str, Any], default_max_tokens: int) -> tuple[int, int]:
    """(samples, tokens) a sample request asks for: num_samples x (prompt + max_tokens)."""
    samples = kwargs["num_samples"]
    max_tokens = getattr(kwargs.get("sampling_params"), "max_tokens", None)
    new_tokens = max_tokens if isinstance(max_tokens, int) and max_tokens >= 0 else default_max_tokens
    length = prompt_length(kwargs.get("prompt")) or 0  # images without expected_tokens: 1 each
    return samples, samples * (length + new_tokens)
