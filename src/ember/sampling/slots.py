"""Per-slot decoding state, held in numpy arrays so a decode step costs a handful of
vectorised operations whatever the number of sequences (no per-token Python loop).

Every array has one entry per slot (`[S]`, S = `num_slots`), or one row per slot for the
outputs (`[S, max_len]`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Placement:
    """Sample `sample` of `request` (a scheduler `RequestState`) decodes in `slot`."""

    request: Any
    sample: int
    slot: int


@dataclass
class SlotTable:
    num_slots: int
    max_len: int
    vocab_size: int
    request: list = field(init=False)  # the RequestState decoding in each slot, None if free
    sample: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        size = self.num_slots
        self.request = [None] * size
        self.sample = np.zeros(size, np.int64)  # which sample of its request
        self.active = np.zeros(size, bool)
        self.position = np.zeros(size, np.int64)  # cache length = position of the token fed next
        self.last_token = np.zeros(size, np.int64)
        self.num_generated = np.zeros(size, np.int64)
        self.max_tokens = np.zeros(size, np.int64)
        self.rope_delta = np.zeros(size, np.int64)  # M-RoPE position - cache position (image prompts)
        # Sampling filters.
        self.temperature = np.ones(size, np.float32)
        self.top_k = np.full(size, self.vocab_size, np.int64)  # top-k filter; vocab_size = off
        self.top_p = np.ones(size, np.float32)
        self.greedy = np.ones(size, bool)
        self.rng_key = np.zeros(size, np.uint64)
        # What to return.
        self.processed_logprobs = np.zeros(size, bool)  # logprobs of the sampled distribution, not the raw one
        self.num_top_logprobs = np.zeros(size, np.int64)  # how many top logprobs to return per token; 0 = none
        self.stop_token_ids = np.full((size, 1), -1, np.int64)  # [S, widest stop list], -1 padded
        self.has_stop_strings = np.zeros(size, bool)
        # Which weights.
        self.full_version_id = np.zeros(size, np.int64)  # 0: base module (+ LoRA hooks); else a full version id
        self.lora_version_id = np.zeros(size, np.int64)  # 0: no LoRA adapter
        self.version: list = [None] * size  # the weight version each slot's next token runs on
        self.generation = np.zeros(size, np.int64)  # followed requests: the follower generation of `version`
        self.spans: list[list] = [[] for _ in range(size)]  # followed: [(first token index, generation)]
        # Outputs.
        self.out_tokens = np.zeros((size, self.max_len), np.int32)
        self.out_logprobs = np.zeros((size, self.max_len), np.float32)
        self.out_top_logprobs: list[list] = [[] for _ in range(size)]  # per token: (ids [k], logprobs [k])
        self.out_routes: list[list] = [[] for _ in range(size)]  # MoE: per token fed back, its (layers, k) experts

    # ---------------------------------------------------------------- occupancy
    def free_slots(self) -> np.ndarray:
        return np.flatnonzero(~self.active)

    def high(self) -> int:
        """1 + the highest active slot (decode rows are slots 0..high-1)."""
        active_slots = np.flatnonzero(self.active)
        return int(active_slots[-1]) + 1 if active_slots.size else 0

    def occupy(self, slots: np.ndarray, request, samples: np.ndarray) -> None:
        """Start samples `samples` of `request` in `slots` (vectorised over one request's samples)."""
        spec, job = request.spec, request.job
        for slot in slots.tolist():
            self.request[slot] = request
            self.out_top_logprobs[slot] = []
            self.out_routes[slot] = []
            self.version[slot] = job.version
            self.spans[slot] = []
        self.sample[slots], self.active[slots] = samples, True
        self.position[slots], self.num_generated[slots], self.max_tokens[slots] = len(spec.prompt), 0, spec.max_tokens
        self.rope_delta[slots] = job.images.delta if job.images is not None else 0
        self.temperature[slots] = spec.temperature if spec.temperature > 0 else 1.0
        self.greedy[slots] = spec.greedy
        self.top_k[slots] = self.vocab_size if spec.top_k == -1 else spec.top_k
        self.top_p[slots] = spec.top_p
        self.processed_logprobs[slots] = spec.logprobs_mode == "processed"
        self.num_top_logprobs[slots] = spec.topk_sample_logprobs
        self.rng_key[slots] = request.sample_keys[samples]
        self.full_version_id[slots], self.lora_version_id[slots] = job.full_version_id, job.lora_version_id
        self._set_stops(slots, spec.stop_token_ids)
        self.has_stop_strings[slots] = bool(spec.stop_strings)

    def _set_stops(self, slots: np.ndarray, ids: tuple[int, ...]) -> None:
        if len(ids) > self.stop_token_ids.shape[1]:
            wider = np.full((self.num_slots, len(ids)), -1, np.int64)
            wider[:, : self.stop_token_ids.shape[1]] = self.stop_token_ids
            self.stop_token_ids = wider
        self.stop_token_ids[slots] = -1
        self.stop_token_ids[slots, : len(ids)] = ids

    def move(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Move the sequences of slots `src` to the free slots `dst` (all per-slot state;
        the caller moves their KV), and free `src`."""
        for value in vars(self).values():
            if isinstance(value, np.ndarray) and value.shape[:1] == (self.num_slots,):
                value[dst] = value[src]
        for source, target in zip(src.tolist(), dst.tolist()):
            self.request[target], self.out_top_logprobs[target] = self.request[source], self.out_top_logprobs[source]
            self.out_routes[target] = self.out_routes[source]
            self.version[target], self.spans[target] = self.version[source], self.spans[source]
            self.release(source)

    def release(self, slot: int) -> None:
        self.request[slot] = None
        self.active[slot] = False
        self.greedy[slot] = True  # idle rows take the cheap greedy path
        self.position[slot] = 0
        self.out_top_logprobs[slot] = []
        self.out_routes[slot] = []
        self.version[slot] = None
        self.spans[slot] = []

    def switch_version(self, slot: int, version, generation: int) -> None:
        """Slot `slot`'s next token runs on `version` (follower generation `generation`)."""
        self.version[slot], self.generation[slot] = version, generation
        is_lora = version is not None and version.is_lora
        self.full_version_id[slot] = version.version_id if version is not None and not is_lora else 0
        self.lora_version_id[slot] = version.version_id if is_lora else 0
        self.spans[slot].append((int(self.num_generated[slot]), generation))

    # ---------------------------------------------------------------- recording
    def record(self, slots: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        """Append one sampled token (and its logprob) to each of `slots`."""
        column = self.num_generated[slots]
        self.out_tokens[slots, column] = tokens
        self.out_logprobs[slots, column] = logprobs
        self.num_generated[slots] = column + 1
        self.last_token[slots] = tokens

    def stop_token_hit(self, slots: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        return (self.stop_token_ids[slots] == tokens[:, None]).any(axis=1)
