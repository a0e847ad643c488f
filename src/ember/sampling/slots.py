"""Per-slot decoding state, held in numpy arrays so a decode step costs a handful of
vectorised operations whatever the number of sequences (no per-token Python loop)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Placement:
    """Sample `sample` of `job` decodes in `slot`."""

    job: Any
    sample: int
    slot: int


@dataclass
class SlotTable:
    num_slots: int
    max_len: int
    vocab_size: int
    job: list = field(init=False)
    sample: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        s = self.num_slots
        self.job = [None] * s
        self.sample = np.zeros(s, np.int64)
        self.active = np.zeros(s, bool)
        self.pos = np.zeros(s, np.int64)  # cache length = position of the token fed next
        self.last_tok = np.zeros(s, np.int64)
        self.n_gen = np.zeros(s, np.int64)
        self.max_new = np.zeros(s, np.int64)
        self.temperature = np.ones(s, np.float32)
        self.top_k = np.full(s, self.vocab_size, np.int64)
        self.top_p = np.ones(s, np.float32)
        self.greedy = np.ones(s, bool)
        self.processed = np.zeros(s, bool)
        self.topk = np.zeros(s, np.int64)
        self.keys = np.zeros(s, np.uint64)
        self.group = np.zeros(s, np.int64)  # 0: base module (+ LoRA hooks); else a full version id
        self.lora = np.zeros(s, np.int64)  # LoRA version id, 0 if none
        self.stop_ids = np.full((s, 1), -1, np.int64)
        self.stop_str = np.zeros(s, bool)
        self.out_tok = np.zeros((s, self.max_len), np.int32)
        self.out_lp = np.zeros((s, self.max_len), np.float32)
        self.out_topk: list[list] = [[] for _ in range(s)]

    # ---------------------------------------------------------------- occupancy
    def free_slots(self) -> np.ndarray:
        return np.flatnonzero(~self.active)

    def high(self) -> int:
        """1 + the highest active slot (decode rows are slots 0..high-1)."""
        idx = np.flatnonzero(self.active)
        return int(idx[-1]) + 1 if idx.size else 0

    def occupy(self, slots: np.ndarray, job, samples: np.ndarray, group: int, lora: int) -> None:
        """Start samples `samples` of `job` in `slots` (vectorised over one request's samples)."""
        spec = job.spec
        for s in slots.tolist():
            self.job[s] = job
            self.out_topk[s] = []
        self.sample[slots], self.active[slots] = samples, True
        self.pos[slots], self.n_gen[slots], self.max_new[slots] = len(spec.prompt), 0, spec.max_tokens
        self.temperature[slots] = spec.temperature if spec.temperature > 0 else 1.0
        self.greedy[slots] = spec.greedy
        self.top_k[slots] = self.vocab_size if spec.top_k == -1 else spec.top_k
        self.top_p[slots] = spec.top_p
        self.processed[slots] = spec.logprobs_mode == "processed"
        self.topk[slots] = spec.topk_sample_logprobs
        self.keys[slots], self.group[slots], self.lora[slots] = job.keys[samples], group, lora
        self._set_stops(slots, spec.stop_token_ids)
        self.stop_str[slots] = bool(spec.stop_strings)

    def _set_stops(self, s: np.ndarray, ids: tuple[int, ...]) -> None:
        if len(ids) > self.stop_ids.shape[1]:
            wider = np.full((self.num_slots, len(ids)), -1, np.int64)
            wider[:, : self.stop_ids.shape[1]] = self.stop_ids
            self.stop_ids = wider
        self.stop_ids[s] = -1
        self.stop_ids[s, : len(ids)] = ids

    def move(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Move the sequences of slots `src` to the free slots `dst` (all per-slot state;
        the caller moves their KV), and free `src`."""
        for value in vars(self).values():
            if isinstance(value, np.ndarray) and value.shape[:1] == (self.num_slots,):
                value[dst] = value[src]
        for a, b in zip(src.tolist(), dst.tolist()):
            self.job[b], self.out_topk[b] = self.job[a], self.out_topk[a]
            self.release(a)

    def release(self, s: int) -> None:
        self.job[s] = None
        self.active[s] = False
        self.greedy[s] = True  # idle rows take the cheap greedy path
        self.pos[s] = 0
        self.out_topk[s] = []

    # ---------------------------------------------------------------- recording
    def record(self, rows: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        """Append one sampled token (and its logprob) to each of `rows`."""
        n = self.n_gen[rows]
        self.out_tok[rows, n] = tokens
        self.out_lp[rows, n] = logprobs
        self.n_gen[rows] = n + 1
        self.last_tok[rows] = tokens

    def stop_token_hit(self, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        return (self.stop_ids[rows] == tokens[:, None]).any(axis=1)
