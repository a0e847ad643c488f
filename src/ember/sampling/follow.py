"""Mid-sequence adoption of in-flight weights (docs/architecture.md, in-flight weights).

A `VersionFollower` is the small thread-safe handle a request carries
(`SamplingRequest.follow`) when it must follow a mutable weight target: the publisher
(the service, on a new in-flight save) calls `publish(version)`; a backend that declares
`Sampler.follows_mid_sequence` reads `current()` before every decode step and runs the
sequence's next token on the newest generation, keeping the KV cache of the tokens
before it (PipelineRL-style: earlier tokens are not recomputed). Each finished sequence
records which generation produced which tokens as `version_spans`: ((first_token_index,
generation), ...), one span per generation, in token order.

A backend that cannot poll before each step (vLLM's engine runs its own loop; a pool's
replicas run in other processes) `subscribe`s instead: its callback hears each publish and
adopts it itself (vLLM: pause the engine between steps, keeping its queue and KV cache,
load the weights in place, resume). A replica mirrors the pool's follower with `adopt`,
which takes a (version, generation) pair as the pool forwards it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

from tinker import types

from ember.sampling.experts import RoutedSequence

VersionSpans = tuple[tuple[int, int], ...]


class VersionFollower:
    """The current version of one mutable weight target and its generation number
    (`generation` for the version it was made with, +1 per `publish`)."""

    def __init__(self, version, generation: int = 0) -> None:
        self._lock = threading.Lock()
        self._generation, self._version = generation, version
        self._generation_of = {id(version): generation}  # which generation each published version was
        self._listeners: list = []

    def publish(self, version) -> int:
        """Make `version` the target's current version; returns its generation. Listeners
        (`subscribe`) hear it after the lock is released, in the publishing thread."""
        with self._lock:
            self._generation += 1
            self._version = version
            self._generation_of[id(version)] = self._generation
            generation, listeners = self._generation, list(self._listeners)
        for listener in listeners:
            listener(generation, version)
        return generation

    def subscribe(self, listener) -> None:
        """Call `listener(generation, version)` after each later publish (once per listener:
        subscribing the same callable again changes nothing). A listener must not block: it
        runs in the publisher's thread (the service's save)."""
        with self._lock:
            if listener not in self._listeners:
                self._listeners.append(listener)

    def adopt(self, version, generation: int) -> int:
        """A mirror's publish (a replica following the pool's follower): record `version`
        as `generation` and make it current if it is newer than the current one (forwards
        can arrive after a request that already carried them; listeners hear it then, as
        for `publish`); returns the current generation."""
        with self._lock:
            self._generation_of[id(version)] = generation
            newer = generation > self._generation
            if newer:
                self._generation, self._version = generation, version
            current, listeners = self._generation, list(self._listeners) if newer else []
        for listener in listeners:
            listener(generation, version)
        return current

    def current(self) -> tuple[int, object]:
        """(generation, version) now; read by the backend before each decode step."""
        with self._lock:
            return self._generation, self._version

    def generation_of(self, version) -> int:
        """The generation `version` was published as (ValueError: never published here)."""
        with self._lock:
            if id(version) not in self._generation_of:
                raise ValueError(f"follow: version {version!r} was never published to this follower")
            return self._generation_of[id(version)]


@dataclass(frozen=True)
class FollowedSequence(RoutedSequence):
    """A `SampledSequence` (routes kept when the model routes) with the generations that
    produced its tokens. The wire and the SDK see a `SampledSequence`."""

    version_spans: VersionSpans = field(default=(), repr=False)


def with_spans(seq: types.SampledSequence, spans: list[tuple[int, int]]) -> FollowedSequence:
    values = {f.name: getattr(seq, f.name) for f in fields(seq) if f.init}
    return FollowedSequence(**values, version_spans=tuple(spans))


def version_spans(seq: types.SampledSequence) -> VersionSpans | None:
    """The ((first_token_index, generation), ...) spans of a followed sequence; None when
    it was not sampled with a follower (one version throughout: the request's)."""
    return getattr(seq, "version_spans", None)


def spans_a_swap(seq: types.SampledSequence) -> bool:
    """True when more than one generation produced the sequence's tokens."""
    return len(version_spans(seq) or ()) > 1
