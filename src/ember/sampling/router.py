"""Which replica of a `SamplerPool` serves a request: session-affine consistent hashing.

Policy (`SessionRouter`, the pool's default):

1. A session already placed stays on its replica while that replica is up, however busy
   it is: its prefix-cache entries and resident versions are there.
2. A new session (or one whose replica went down) goes to its *home*: the replica owning
   the first of `vnodes` virtual nodes per replica at or after the hash of the session
   id on a ring of 2**64 (blake2b; stable across processes and restarts). Losing or adding
   a replica moves only the sessions whose home it was or becomes.
3. Spill: if the home has more than `max_imbalance` requests in flight beyond the least
   busy up replica, the new session goes to the least busy one instead (ties: lowest
   index), and stays there (rule 1).
4. A replica taken out (dead, not answering) forgets its sessions; they follow rule 2 on
   their next request. A replica put back gets new sessions only: the sessions that
   moved away keep their new, warm replica.

Placements are remembered for the `remembered` most recently used sessions; a forgotten
session is placed again by rule 2 (usually the same replica).

`RoundRobinRouter` ignores sessions (each request to the next up replica): the baseline
of benchmarks/sampling_pool.py. Both are pure bookkeeping (no I/O, no clock, no threads;
the pool serializes calls) and take the in-flight depths of the up replicas as input.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping


class NoReplicaError(LookupError):
    """No replica is up to take the request."""


def stable_hash(key: str) -> int:
    """A 64-bit hash of `key`, the same in every process (unlike `hash`)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing of string keys onto integer nodes, `vnodes` points per node."""

    def __init__(self, nodes: Iterable[int] = (), vnodes: int = 64) -> None:
        if vnodes < 1:
            raise ValueError(f"HashRing: vnodes must be >= 1, got {vnodes}")
        self.vnodes = vnodes
        self._points: list[tuple[int, int]] = []  # (position, node), sorted
        self._nodes: set[int] = set()
        for node in nodes:
            self.add(node)

    @property
    def nodes(self) -> set[int]:
        return set(self._nodes)

    def __contains__(self, node: int) -> bool:
        return node in self._nodes

    def add(self, node: int) -> None:
        if node in self._nodes:
            return
        self._nodes.add(node)
        for v in range(self.vnodes):
            bisect.insort(self._points, (stable_hash(f"replica-{node}#{v}"), node))

    def remove(self, node: int) -> None:
        self._nodes.discard(node)
        self._points = [p for p in self._points if p[1] != node]

    def lookup(self, key: str) -> int:
        if not self._points:
            raise NoReplicaError("no sampler replica is up")
        i = bisect.bisect_left(self._points, (stable_hash(key), -1))
        return self._points[i % len(self._points)][1]


class SessionRouter:
    """The session-affine policy of the module docstring."""

    def __init__(self, replicas: Iterable[int], max_imbalance: int, vnodes: int = 64,
                 remembered: int = 65536) -> None:
        self.ring = HashRing(replicas, vnodes)
        self.max_imbalance = max_imbalance
        self.remembered = remembered
        self._placed: OrderedDict[str, int] = OrderedDict()

    def route(self, session: str, depths: Mapping[int, int]) -> int:
        """The replica for a request of `session`; `depths`: requests in flight per up replica."""
        placed = self._placed.get(session)
        if placed is not None and placed in self.ring:
            self._placed.move_to_end(session)
            return placed
        choice = self.ring.lookup(session)
        up = sorted(self.ring.nodes)
        least = min(up, key=lambda r: (depths.get(r, 0), r))
        if depths.get(choice, 0) - depths.get(least, 0) > self.max_imbalance:
            choice = least
        self._placed[session] = choice
        self._placed.move_to_end(session)
        while len(self._placed) > self.remembered:
            self._placed.popitem(last=False)
        return choice

    def remove(self, replica: int) -> list[str]:
        """Take `replica` out; returns the sessions it held (they are placed again on use)."""
        self.ring.remove(replica)
        moved = [s for s, r in self._placed.items() if r == replica]
        for session in moved:
            del self._placed[session]
        return moved

    def add(self, replica: int) -> None:
        self.ring.add(replica)

    def placement(self, session: str) -> int | None:
        return self._placed.get(session)


class RoundRobinRouter:
    """Each request to the next up replica, whatever its session (a baseline)."""

    def __init__(self, replicas: Iterable[int], max_imbalance: int = 0) -> None:
        self._up = set(replicas)
        self._next = 0

    def route(self, session: str, depths: Mapping[int, int]) -> int:
        if not self._up:
            raise NoReplicaError("no sampler replica is up")
        up = sorted(self._up)
        choice = up[self._next % len(up)]
        self._next += 1
        return choice

    def remove(self, replica: int) -> list[str]:
        self._up.discard(replica)
        return []

    def add(self, replica: int) -> None:
        self._up.add(replica)
