"""A bounded prefix cache for TorchSampler: the KV of prompt prefixes, reused across requests.

An entry is the KV (every layer) of the first L tokens of a prompt that was prefilled,
L a multiple of `block` tokens. It is keyed by the owner whose request computed it and
the weights that computed it (`Job.cache_key`: owner, the full version's id and the LoRA
adapter version's id, 0 for the base model and for no adapter), so no request ever reads
KV of other weights, and a hit (`prompt_cache_hit_tokens`) only ever reflects the
caller's own earlier prompts, never another tenant's (docs/architecture.md, trust
boundaries). Version ids are never reused; when a version is released its entries are
dropped (`forget`).

Eviction keeps the total under `max_tokens` positions: the least recently used entry of
the owner holding the most positions goes first. So a tenant's entries are evicted by
another's traffic only while it holds at least as much as every other tenant: a heavy
tenant flushes its own entries, not a light neighbour's.

Only the worker thread reads and fills the cache; `forget` may come from any thread (a
version's finaliser), hence the lock.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import numpy as np
import torch

Snapshot = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values) [kv_heads, L, head_dim]
CacheKey = tuple[str, int, int]  # (owner, full version id or 0, LoRA version id or 0)


class PrefixCache:
    def __init__(self, max_tokens: int, block: int = 16) -> None:
        self.max_tokens = max_tokens
        self.block = block
        self._entries: OrderedDict[tuple[CacheKey, tuple[int, ...]], Snapshot] = OrderedDict()
        self._tokens = 0
        self._owner_tokens: dict[str, int] = {}  # positions held per owner (eviction order)
        self._lock = threading.Lock()
        self._watched: set[int] = set()

    @property
    def enabled(self) -> bool:
        return self.max_tokens >= self.block

    def cached_tokens(self) -> int:
        return self._tokens

    def debug_state(self) -> dict[str, list[Snapshot]]:
        """The one inspection point of the cache (read-only): `snapshots`, the stored snapshots,
        least recently used first (a new list of the cached tensors themselves, not copies; do
        not write to them)."""
        with self._lock:
            return {"snapshots": list(self._entries.values())}

    def lookup(self, key: CacheKey, prompt: tuple[int, ...], limit: int) -> tuple[int, Snapshot | None]:
        """(h, KV) of the longest cached block-aligned prefix of `prompt` of at most `limit` tokens."""
        limit = (limit // self.block) * self.block
        if not self.enabled or limit <= 0:
            return 0, None
        arr = np.asarray(prompt[:limit], dtype=np.int64)
        best, best_key = 0, None
        with self._lock:
            for k in self._entries:
                if k[0] != key:
                    continue
                n = min(len(k[1]), limit)
                diff = np.flatnonzero(np.asarray(k[1][:n], dtype=np.int64) != arr[:n])
                common = int(diff[0]) if diff.size else n
                common = (common // self.block) * self.block
                if common > best:
                    best, best_key = common, k
            if best_key is None:
                return 0, None
            self._entries.move_to_end(best_key)
            snap = self._entries[best_key]
        return best, [(k[:, :best], v[:, :best]) for k, v in snap]

    def wanted_length(self, prompt_len: int) -> int:
        """Block-aligned length an entry for a prompt of `prompt_len` tokens holds (its last
        token is left out: a request always computes at least one position)."""
        return ((prompt_len - 1) // self.block) * self.block if self.enabled else 0

    def contains(self, key: CacheKey, prefix: tuple[int, ...]) -> bool:
        with self._lock:
            return (key, prefix) in self._entries

    def insert(self, key: CacheKey, prefix: tuple[int, ...], snapshot: Snapshot, version=None) -> None:
        n = len(prefix)
        if not self.enabled or n == 0 or n > self.max_tokens:
            return
        with self._lock:
            if (key, prefix) in self._entries:
                self._entries.move_to_end((key, prefix))
                return
            self._entries[(key, prefix)] = snapshot
            self._count(key[0], n)
            while self._tokens > self.max_tokens:
                self._evict_one()
            if version is not None and version.version_id not in self._watched:
                self._watched.add(version.version_id)
                weakref.finalize(version, self.forget, version.version_id)

    def _count(self, owner: str, n: int) -> None:
        self._tokens += n
        left = self._owner_tokens.get(owner, 0) + n
        if left:
            self._owner_tokens[owner] = left
        else:
            del self._owner_tokens[owner]

    def _evict_one(self) -> None:
        """Drop the least recently used entry of the owner holding the most positions."""
        heaviest = max(self._owner_tokens, key=self._owner_tokens.__getitem__)
        victim = next(k for k in self._entries if k[0][0] == heaviest)
        del self._entries[victim]
        self._count(heaviest, -len(victim[1]))

    def owner_tokens(self, owner: str) -> int:
        """Positions cached for `owner`'s requests."""
        with self._lock:
            return self._owner_tokens.get(owner, 0)

    def forget(self, version_id: int) -> None:
        """Drop every entry computed with version `version_id` (it was released)."""
        with self._lock:
            self._watched.discard(version_id)
            for k in [k for k in self._entries if version_id in k[0][1:]]:
                del self._entries[k]
                self._count(k[0][0], -len(k[1]))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._owner_tokens.clear()
            self._tokens = 0
