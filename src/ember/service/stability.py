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
  A mixture-of-experts sample from TorchSampler also leaves its routes (the experts each
  layer chose per token), for routing replay (`ember.service.routing_records`).
* **Where**: in memory (`StabilityRecords`), bounded in real bytes per owner and in total
  (least recently used records are evicted first, O(1) each), with the sliding one-day
  expiry.
  Records do not survive a restart: they are only useful to a live async-RL loop, whose
  samplers (snapshots) do not survive one either; a datum naming a lost record gets the
  "no record" error below.
* **Checks** on a ``stable_reinforce`` datum (each a `UserError` naming datum, field, span
  and reason): provenance present; runs tile their field; every named sequence is
  recorded for this owner *and* session (another tenant's or session's id reads exactly
  like an unknown one); not expired; ``offset + length`` within the recorded prompt /
  sampled tokens; the datum's input tokens and its *sampled* target tokens equal the
  recorded ones. Target tokens under a prompt run are placeholders, not compared: prompt
  positions carry no loss (below), and tinker-cookbook's ``rl_loop`` sends zeros there.
* Records of a session are dropped when it finishes or expires. Losses other than
  ``stable_reinforce`` ignore provenance spans.
* **Resolution**: target position t covered by a sampled run gets the recorded sampler
  log-prob q_t and ``sampled_mask`` 1; a position covered by a prompt run gets q_t = 0,
  mask 0 (no sampler log-prob exists there; the loss ignores it). A ``logprobs`` input
  sent by the client is replaced by the record.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tinker import types

from ember.service.api import UserError
from ember.service.clock import SYSTEM_CLOCK, Clock
from ember.service.config import DAY_S, StabilityConfig  # noqa: F401 (DAY_S: the default ttl, for callers)
from ember.service.provenance import resolve_datum

# Memory of one record besides its arrays' data, measured with tracemalloc
# (tests/service/test_service_stability.py checks the accounting against it): the slotted
# record, its two numpy array headers, its id string, and its entries in the global and
# per-owner LRU dicts and its session's set.
RECORD_OVERHEAD_BYTES = 2 * sys.getsizeof(np.zeros(0, np.int32)) + 360


@dataclass(slots=True, eq=False)
class SequenceRecord:
    owner: str
    session_id: str
    prompt: np.ndarray | None  # int32 prompt ids, shared by the sample's sequences (None: non-token chunks)
    tokens: np.ndarray  # int32 sampled ids
    logprobs: np.ndarray  # float32 sampler log-probs of `tokens`
    last_used: float = 0.0
    nbytes: int = 0  # what it costs in memory (see `record_bytes`)
    # a mixture-of-experts sample's routes (`ember.sampling.experts.RoutedSequence`), else None
    prompt_routes: np.ndarray | None = None  # (P, layers, k), shared by the sample's sequences
    routes: np.ndarray | None = None  # (len(tokens) - 1, layers, k)
    # an in-flight sample that followed its run mid-sequence (`ember.sampling.follow`): which
    # in-flight generation produced which tokens, ((first_token_index, generation), ...); else None
    version_spans: tuple | None = None


def record_bytes(tokens: np.ndarray, logprobs: np.ndarray, prompt_share: int) -> int:
    """Real bytes of one record: overhead + its arrays' data + its share of the prompt."""
    return RECORD_OVERHEAD_BYTES + tokens.nbytes + logprobs.nbytes + prompt_share


def _arrays(seq: types.SampledSequence) -> tuple[np.ndarray, np.ndarray | None]:
    """(int32 tokens, float32 logprobs or None), from the numpy form when the sequence has
    it (the samplers' responses do): no round trip through Python lists."""
    tokens = seq.tokens_np if getattr(seq, "tokens_np", None) is not None else seq.tokens
    logprobs = seq.logprobs_np if getattr(seq, "logprobs_np", None) is not None else seq.logprobs
    return (np.array(tokens, dtype=np.int32),  # a copy: the record never shares the response's buffers
            None if logprobs is None else np.array(logprobs, dtype=np.float32))


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds:.1f} s"


def prompt_ids(prompt: types.ModelInput) -> np.ndarray | None:
    """The prompt's token ids, or None when it holds image/dmel chunks (no token ids)."""
    if not all(isinstance(c, types.EncodedTextChunk) for c in prompt.chunks):
        return None
    return np.asarray(prompt.to_ints(), dtype=np.int32)


class StabilityRecords:
    """Owner- and session-scoped, bounded, expiring records of sampled sequences.

    Every operation costs O(1) per record it adds, touches or drops: the records are kept
    in one dict ordered by last use (total bound, expiry) and one per owner (the owner's
    bound), and indexed by session (`drop_session`), so `record` — called on the finisher
    threads that complete every tenant's samples — never scans other records."""

    def __init__(self, config: StabilityConfig | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config or StabilityConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, SequenceRecord] = OrderedDict()  # sequence_id -> record, by last use
        self._owner_lru: dict[str, OrderedDict[str, None]] = {}  # owner -> its sequence ids, by last use
        self._sessions: dict[str, set[str]] = {}  # session id -> its sequence ids
        self._owner_bytes: dict[str, int] = {}
        self._total = 0

    def __len__(self) -> int:
        return len(self._lru)

    def bytes_used(self, owner: str | None = None) -> int:
        """Accounted bytes of every record (or of `owner`'s)."""
        with self._lock:
            return self._total if owner is None else self._owner_bytes.get(owner, 0)

    # ------------------------------------------------------------------ recording
    def record(self, owner: str, session_id: str, prompt: types.ModelInput,
               response: types.SampleResponse) -> None:
        """Keep every sequence of a finished sample (called before its future completes)."""
        ids = prompt_ids(prompt)
        kept = [seq for seq in response.sequences if seq.sequence_id]
        share = 0 if ids is None or not kept else -(-(ids.nbytes + sys.getsizeof(ids)) // len(kept))
        prompt_routes = getattr(kept[0], "prompt_routes_np", None) if kept else None
        if prompt_routes is not None:  # one copy for the sample's sequences, shared like the prompt
            prompt_routes = np.array(prompt_routes, dtype=np.int16)
            share += -(-prompt_routes.nbytes // len(kept))
        now = self._clock()
        new = [(seq.sequence_id, self._new_record(owner, session_id, ids, seq, share, now, prompt_routes))
               for seq in kept]
        with self._lock:
            for sequence_id, rec in new:
                self._drop(sequence_id)
                self._add(sequence_id, rec)
            self._evict(owner)

    @staticmethod
    def _new_record(owner, session_id, ids, seq, share: int, now: float,
                    prompt_routes: np.ndarray | None = None) -> SequenceRecord:
        tokens, logprobs = _arrays(seq)
        if logprobs is None or logprobs.shape != tokens.shape:
            raise RuntimeError(f"sequence {seq.sequence_id}: the sampler returned no logprob per token")
        routes = getattr(seq, "routes_np", None)
        routes = None if routes is None else np.array(routes, dtype=np.int16)
        nbytes = record_bytes(tokens, logprobs, share) + (0 if routes is None else routes.nbytes)
        return SequenceRecord(owner, session_id, ids, tokens, logprobs, now, nbytes, prompt_routes, routes,
                              getattr(seq, "version_spans", None))

    def _add(self, sequence_id: str, rec: SequenceRecord) -> None:
        self._lru[sequence_id] = rec
        self._owner_lru.setdefault(rec.owner, OrderedDict())[sequence_id] = None
        self._sessions.setdefault(rec.session_id, set()).add(sequence_id)
        self._owner_bytes[rec.owner] = self._owner_bytes.get(rec.owner, 0) + rec.nbytes
        self._total += rec.nbytes

    def _drop(self, sequence_id: str) -> None:
        rec = self._lru.pop(sequence_id, None)
        if rec is None:
            return
        owned = self._owner_lru[rec.owner]
        del owned[sequence_id]
        session = self._sessions[rec.session_id]
        session.discard(sequence_id)
        if not session:
            del self._sessions[rec.session_id]
        left = self._owner_bytes[rec.owner] - rec.nbytes
        if owned:
            self._owner_bytes[rec.owner] = left
        else:
            del self._owner_bytes[rec.owner], self._owner_lru[rec.owner]
        self._total -= rec.nbytes

    def _evict(self, owner: str) -> None:
        """Least recently used first: the owner's own records over its budget, then anyone's."""
        cfg = self.config
        while self._owner_bytes.get(owner, 0) > cfg.max_bytes_per_owner:
            self._drop(next(iter(self._owner_lru[owner])))
        while self._total > cfg.max_bytes_total and self._lru:
            self._drop(next(iter(self._lru)))

    def expire(self) -> int:
        """Drop records unused for longer than ttl_s (housekeeping). Returns how many."""
        cutoff = self._clock() - self.config.ttl_s
        dropped = 0
        with self._lock:
            while self._lru:
                sequence_id, rec = next(iter(self._lru.items()))
                if rec.last_used >= cutoff:
                    break
                self._drop(sequence_id)
                dropped += 1
        return dropped

    def drop_session(self, session_id: str) -> None:
        """A finished or expired session's records go with it (no request can name them)."""
        with self._lock:
            for sid in list(self._sessions.get(session_id, ())):
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
            self._owner_lru[rec.owner].move_to_end(sequence_id)
            return rec

    def provenance(self, owner: str, session_id: str, sequence_id: str) -> dict:
        """What a client may read of its record (`ServiceAPI.sequence_provenance`); `lookup`'s errors."""
        rec = self.lookup(owner, session_id, sequence_id, "sequence_provenance")
        spans = None if rec.version_spans is None else \
            [{"first_token": int(first), "generation": int(gen)} for first, gen in rec.version_spans]
        return {"session_id": session_id, "sequence_id": sequence_id, "num_tokens": int(len(rec.tokens)),
                "version_spans": spans, "spans_a_swap": spans is not None and len(spans) > 1}

    def resolve(self, owner: str, session_id: str, data: Sequence[types.Datum]) -> list[types.Datum]:
        """`stable_reinforce` datums with ``logprobs`` and ``sampled_mask`` filled in from the
        records their provenance names (see the module docstring); UserError otherwise."""
        return [resolve_datum(self, owner, session_id, i, d) for i, d in enumerate(data)]
