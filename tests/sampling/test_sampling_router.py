"""The pool's router (ember.sampling.router): pure bookkeeping, so every rule of its
policy is checked here without a replica."""

from __future__ import annotations

import pytest

from ember.sampling.router import HashRing, NoReplicaError, RoundRobinRouter, SessionRouter, stable_hash

SESSIONS = [f"session-{i}:sample:{i % 7}" for i in range(2000)]


def _place(router, sessions, depths=None):
    return {s: router.route(s, depths or {}) for s in sessions}


def test_stable_hash_is_the_same_in_every_process():
    # A fixed value: Python's salted hash() would differ per process and move every session on restart.
    assert stable_hash("session-0") == int.from_bytes(
        __import__("hashlib").blake2b(b"session-0", digest_size=8).digest(), "big")
    assert stable_hash("a") != stable_hash("b")


def test_sessions_spread_over_replicas_and_stay():
    router = SessionRouter(range(4), max_imbalance=8)
    first = _place(router, SESSIONS)
    counts = [list(first.values()).count(r) for r in range(4)]
    # 64 virtual nodes per replica: each gets a fair share (25 % +- 12 points of 2000).
    assert all(260 <= c <= 740 for c in counts), counts
    assert _place(router, SESSIONS) == first
    # A fresh router (a restarted server) places them identically.
    assert _place(SessionRouter(range(4), max_imbalance=8), SESSIONS) == first


def test_losing_a_replica_moves_only_its_sessions():
    router = SessionRouter(range(3), max_imbalance=8)
    before = _place(router, SESSIONS)
    moved = router.remove(1)
    assert sorted(moved) == sorted(s for s, r in before.items() if r == 1)
    after = _place(router, SESSIONS)
    for s in SESSIONS:
        if before[s] == 1:
            assert after[s] in (0, 2)
        else:
            assert after[s] == before[s], s
    # The same as a ring that never had replica 1 (consistent hashing, not a reshuffle).
    assert after == _place(SessionRouter([0, 2], max_imbalance=8), SESSIONS)


def test_a_replica_put_back_takes_new_sessions_only():
    router = SessionRouter(range(2), max_imbalance=8)
    before = _place(router, SESSIONS[:500])
    router.remove(0)
    moved = _place(router, SESSIONS[:500])
    assert set(moved.values()) == {1}
    router.add(0)
    assert _place(router, SESSIONS[:500]) == moved  # the moved sessions keep their warm replica
    fresh = _place(router, SESSIONS[500:1000])
    assert 0 in fresh.values() and 1 in fresh.values()
    assert before  # (placed before the loss)


def test_new_sessions_spill_past_max_imbalance_placed_ones_stay():
    router = SessionRouter(range(2), max_imbalance=3)
    home = {s: router.ring.lookup(s) for s in SESSIONS[:200]}
    to_0 = [s for s in SESSIONS[:200] if home[s] == 0]
    old, new, newer = to_0[0], to_0[1], to_0[2]
    assert router.route(old, {0: 0, 1: 0}) == 0
    # Exactly max_imbalance deeper: no spill.
    assert router.route(new, {0: 3, 1: 0}) == 0
    # More than max_imbalance deeper: a new session goes to the least busy replica ...
    assert router.route(newer, {0: 4, 1: 0}) == 1
    # ... and stays there; a placed session never spills.
    assert router.route(newer, {0: 0, 1: 9}) == 1
    assert router.route(old, {0: 50, 1: 0}) == 0


def test_forgotten_sessions_are_placed_again_by_the_ring():
    router = SessionRouter(range(3), max_imbalance=8, remembered=10)
    placed = _place(router, SESSIONS[:100])
    assert all(router.placement(s) is None for s in SESSIONS[:90])
    assert _place(router, SESSIONS[:100]) == placed


def test_no_replica_up_is_an_error_not_a_hang():
    router = SessionRouter([0], max_imbalance=0)
    router.remove(0)
    with pytest.raises(NoReplicaError):
        router.route("s", {})
    with pytest.raises(NoReplicaError):
        HashRing([]).lookup("s")
    with pytest.raises(NoReplicaError):
        RoundRobinRouter([]).route("s", {})


def test_round_robin_ignores_sessions():
    router = RoundRobinRouter(range(2))
    assert [router.route("same", {}) for _ in range(4)] == [0, 1, 0, 1]
    router.remove(0)
    assert [router.route("same", {}) for _ in range(2)] == [1, 1]
