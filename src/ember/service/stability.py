"""Stability records: what a `record_stability_info=True` sample keeps for `stable_reinforce`.

What follows Tinker's documentation (tinker-docs …/losses/stable-reinforce, …/datum):

* a sampling client made with ``record_stability_info=True`` sends the flag on every
  sample; each returned sequence carries a ``sequence_id`` that training requests name;
* recorded sequences belong to the **session** that sampled them ("a training request can
  only name sequences sampled in its own session"), and can be trained on for **one day**
  after sampling; each training request that uses a sequence restarts that day;
* a datum names its sources with ``Datum.with_provenance``: runs of
  ``PromptProvenanceSpan`` / ``SampledProvenanceSpan(sequence_id, offset, length)`` that
  tile ``model_input`` and ``loss_fn_inputs["target_tokens"]``, in order.

What is ember's choice (the docs do not say):

* **What is recorded**, per sequence: its prompt token ids, its sampled token ids and the
  sampler's log-probabilities of those tokens (``SampledSequence.logprobs``), with the
  owner and session id. That is all `ember.losses.functions.stable_reinforce` needs.
* **Where**: in memory (`StabilityRecords`), bounded by a token budget per owner and in
  total (least recently used records are evicted first), with the sliding one-day expiry.
  Records do not survive a restart: they are only useful to a live async-RL loop, whose
  samplers (snapshots) do not survive one either; a datum naming a lost record gets the
  "no record" error below.
* **Checks** on a ``stable_reinforce`` datum (each a `UserError` naming datum, field, span
  and reason): provenance present; runs tile their field; every named sequence is
  recorded for this owner *and* session (another tenant's or session's id reads exactly
  like an unknown one); not expired; ``offset + length`` within the recorded prompt /
  sampled tokens; the datum's tokens equal the recorded ones.
* Records of a session are dropped when it finishes or expires. Losses other than
  ``stable_reinforce`` ignore provenance spans.
* **Resolution**: target position t covered by a sampled run gets the recorded sampler
  log-prob q_t and ``sampled_mask`` 1; a position covered by a prompt run gets q_t = 0,
  mask 0 (no sampler log-prob exists there; the loss ignores it). A ``logprobs`` input
  sent by the client is replaced by the record.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from tinker import types

from ember.service.api import UserError
from ember.service.provenance import resolve_datum

DAY_S = 24 * 3600.0


@dataclass
class StabilityConfig:
    """Expiry and memory bounds of the stability records (`[stability]`).

    ttl_s: a record lives this long after its last use (sampling or training; Tinker:
        one day).
    max_tokens_per_owner / max_tokens_total: memory bounds (per API key; all keys
        together), counted as prompt + sampled tokens per record (each ~12 bytes); over a
        bound, least recently used go first.
    """

    ttl_s: float = DAY_S
    max_tokens_per_owner: int = 16_000_000
    max_tokens_total: int = 64_000_000

    def __post_init__(self) -> None:
        if not self.ttl_s > 0:
            raise ValueError(f"StabilityConfig.ttl_s must be > 0, got {self.ttl_s}")
        for name in ("max_tokens_per_owner", "max_tokens_total"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"StabilityConfig.{name} must be an integer >= 1, got {value!r}")


@dataclass
class SequenceRecord:
    owner: str
    session_id: str
    prompt: np.ndarray | None  # int64 prompt ids (None when the prompt had non-token chunks)
    tokens: np.ndarray  # int64 sampled ids
    logprobs: np.ndarray  # float32 sampler log-probs of `tokens`
    last_used: float = field(default=0.0)

    @property
    def size(self) -> int:
        return int(self.tokens.size) + (0 if self.prompt is None else int(self.prompt.size))


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds:.1f} s"


def prompt_ids(prompt: types.ModelInput) -> np.ndarray | None:
    """The prompt's token ids, or None when it holds image/dmel chunks (no token ids)."""
    if not all(isinstance(c, types.EncodedTextChunk) for c in prompt.chunks):
        return None
    return np.asarray(prompt.to_ints(), dtype=np.int64)


class StabilityRecords:
    """Owner- and session-scoped, bounded, expiring records of sampled sequences."""

    def __init__(self, config: StabilityConfig | None = None, clock: Callable[[], float] = time.time) -> None:
        self.config = config or StabilityConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, SequenceRecord] = OrderedDict()  # sequence_id -> record
        self._owner_tokens: dict[str, int] = {}
        self._total = 0

    def __len__(self) -> int:
        return len(self._lru)

    # ------------------------------------------------------------------ recording
    def record(self, owner: str, session_id: str, prompt: types.ModelInput,
               response: types.SampleResponse) -> None:
        """Keep every sequence of a finished sample (called before its future completes)."""
        ids = prompt_ids(prompt)
        now = self._clock()
        with self._lock:
            for seq in response.sequences:
                if not seq.sequence_id:
                    continue
                if seq.logprobs is None or len(seq.logprobs) != len(seq.tokens):
                    raise RuntimeError(f"sequence {seq.sequence_id}: the sampler returned no logprob per token")
                rec = SequenceRecord(owner, session_id, ids, np.asarray(seq.tokens, dtype=np.int64),
                                     np.asarray(seq.logprobs, dtype=np.float32), now)
                self._drop(seq.sequence_id)
                self._lru[seq.sequence_id] = rec
                self._owner_tokens[owner] = self._owner_tokens.get(owner, 0) + rec.size
                self._total += rec.size
            self._evict(owner)

    def _drop(self, sequence_id: str) -> None:
        rec = self._lru.pop(sequence_id, None)
        if rec is not None:
            left = self._owner_tokens[rec.owner] - rec.size
            if left:
                self._owner_tokens[rec.owner] = left
            else:
                del self._owner_tokens[rec.owner]
            self._total -= rec.size

    def _evict(self, owner: str) -> None:
        """Least recently used first: the owner's own records over its budget, then anyone's."""
        cfg = self.config
        if self._owner_tokens.get(owner, 0) > cfg.max_tokens_per_owner:
            for sid in [s for s, r in self._lru.items() if r.owner == owner]:
                if self._owner_tokens.get(owner, 0) <= cfg.max_tokens_per_owner:
                    break
                self._drop(sid)
        while self._total > cfg.max_tokens_total and self._lru:
            self._drop(next(iter(self._lru)))

    def expire(self) -> int:
        """Drop records unused for longer than ttl_s (housekeeping). Returns how many."""
        cutoff = self._clock() - self.config.ttl_s
        with self._lock:
            old = [s for s, r in self._lru.items() if r.last_used < cutoff]
            for sid in old:
                self._drop(sid)
        return len(old)

    def drop_session(self, session_id: str) -> None:
        """A finished or expired session's records go with it (no request can name them)."""
        with self._lock:
            for sid in [s for s, r in self._lru.items() if r.session_id == session_id]:
                self._drop(sid)

    # ------------------------------------------------------------------ lookup
    def lookup(self, owner: str, session_id: str, sequence_id: str, where: str) -> SequenceRecord:
        """The record, its day restarted; `UserError` naming `where` when it is not usable."""
        now = self._clock()
        with self._lock:
            rec = self._lru.get(sequence_id)
            if rec is None or rec.owner != owner or rec.session_id != session_id:
                raise UserError(
                    f"{where}: no stability record for sequence_id {sequence_id!r} in this session: it was "
                    "not sampled in this session by a sampling client with record_stability_info=True, or its "
                    "record was evicted (memory bound) or lost in a server restart"
                )
            age = now - rec.last_used
            if age > self.config.ttl_s:
                self._drop(sequence_id)
                raise UserError(
                    f"{where}: the stability record of sequence_id {sequence_id!r} expired: last used "
                    f"{_duration(age)} ago, records live {_duration(self.config.ttl_s)} after their last use"
                )
            rec.last_used = now
            self._lru.move_to_end(sequence_id)
            return rec

    def resolve(self, owner: str, session_id: str, data: Sequence[types.Datum]) -> list[types.Datum]:
        """`stable_reinforce` datums with ``logprobs`` and ``sampled_mask`` filled in from the
        records their provenance names (see the module docstring); UserError otherwise."""
        return [resolve_datum(self, owner, session_id, i, d) for i, d in enumerate(data)]
