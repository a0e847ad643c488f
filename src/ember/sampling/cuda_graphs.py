"""`SamplerConfig.cuda_graphs`: TorchSampler's decode step over static shapes, captured
once per shape into a `torch.cuda.CUDAGraph` and replayed.

A decode step on a GPU is launch-bound (hundreds of small kernels for a few rows), and a
CUDA graph replays a recorded sequence of kernels with one launch, but only over the
same shapes and the same addresses. So the static step:

* pads the batch to a bucket (`bucket`: 1, 2, 4, ..., max_slots); a pad row repeats row
  0 (same token, position and slot: it writes the same K/V to the same place, and its
  logits are dropped);
* reads a KV prefix of a bucket length (powers of two from `KV_MIN` up to the cache's
  capacity) instead of the step's exact length: the decode mask, computed inside the
  step from the rows' positions, hides every position past a row's own;
* copies its inputs (token ids, positions, slots) into persistent tensors of that shape
  and returns the logits of a persistent output tensor.

On CUDA each (batch bucket, KV bucket) step is captured once (warm-up on a side stream,
then `torch.cuda.graph` with one memory pool shared by all buckets, as PyTorch's CUDA
graphs notes describe) and replayed; on CPU the same static step runs eagerly, which is
what the CPU tests compare with the dynamic step. Every bucket keeps its output tensor
for as long as its graph lives, so no capture reuses memory another graph's output still
holds, and graphs of the shared pool may replay in any order (never concurrently: one
worker thread decodes). Manual capture rather than
torch.compile(mode="reduce-overhead"): which steps are captured, and when, is then
explicit and counted. The KV cache is allocated at its full `max_len` up front (as vLLM
does), so its address never changes under a graph; a `release` (colocation's sleep)
changes it, and the graphs of the old address are dropped and captured again.

A step whose rows all sample one LoRA version runs static too: the version's factors are
copied into persistent buffers of its adapter signature (modules and shapes;
`StaticAdapter`, one set per signature, the size of one adapter) when it differs from the
last one loaded, so the graph of (rows, KV, signature) reads any such version. Steps the
static path does not take run the dynamic step and are counted by reason in `fallbacks`:
several LoRA versions in one batch ("lora_mixed": per-row adapter choices are index plans
that change every step), full fine-tuning versions (a whole weight set per version),
prefills, prefix-cache extends, and anything past the largest bucket.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ember.sampling.kv_cache import SlotCache
from ember.sampling.weights import LoraDelta, TorchWeightVersion

KV_MIN = 64  # the smallest KV bucket: shorter reads gain nothing from their own graph


def bucket(n: int, limit: int, smallest: int = 1) -> int | None:
    """The smallest power of two >= max(n, smallest), capped at `limit` (itself a bucket
    when it is not a power of two); None when n > limit (no bucket holds it)."""
    if n < 1 or limit < 1:
        raise ValueError(f"bucket: n and limit must be >= 1, got n={n}, limit={limit}")
    if n > limit:
        return None
    size = 1
    while size < max(n, smallest):
        size *= 2
    return min(size, limit)


@dataclass
class GraphStats:
    """Counters of the static decode path (`TorchSampler.debug_state()["cuda_graphs"]`)."""

    captured: int = 0  # graphs captured (CUDA only)
    replays: int = 0  # steps replayed from a graph (CUDA only)
    static_steps: int = 0  # steps run through the static path (CUDA: replays; CPU: eager)
    fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> steps run dynamically
    invalidations: int = 0  # times the KV cache moved and the graphs were dropped
    capture_seconds: float = 0.0

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    def as_dict(self) -> dict:
        return {"captured": self.captured, "replays": self.replays, "static_steps": self.static_steps,
                "fallbacks": dict(self.fallbacks), "invalidations": self.invalidations,
                "capture_seconds": round(self.capture_seconds, 3)}


def adapter_signature(version: TorchWeightVersion) -> tuple:
    """What a LoRA version's static buffers must match: its modules and factor shapes."""
    return tuple(sorted((m, tuple(d.a.shape), tuple(d.b.shape)) for m, d in version.lora.items()))


class StaticAdapter:
    """Persistent LoRA factors of one adapter signature, as a decoder LoRA plan whose rows
    are all rows: a version is copied in when it differs from the last one loaded, so a
    graph reads whichever version the step uses from the same addresses."""

    def __init__(self, version: TorchWeightVersion) -> None:
        self.plan = {m: [(None, LoraDelta(torch.empty_like(d.a), torch.empty_like(d.b),
                                          torch.zeros((), dtype=torch.float32, device=d.a.device)))]
                     for m, d in version.lora.items()}
        self.loaded = lambda: None  # a weak reference to the version copied in last

    def load(self, version: TorchWeightVersion) -> None:
        if self.loaded() is version:
            return
        for m, d in version.lora.items():
            static = self.plan[m][0][1]
            static.a.copy_(d.a)
            static.b.copy_(d.b)
            static.scale.fill_(d.scale)
        self.loaded = weakref.ref(version)


class _Bucket:
    """One (batch, KV, adapter) shape's persistent inputs, its output and (CUDA) its graph."""

    def __init__(self, rows: int, kv: int, device: torch.device, lora: dict | None) -> None:
        self.rows, self.kv, self.lora = rows, kv, lora
        self.ids = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.zeros(rows, dtype=torch.long, device=device)
        self.out: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def load(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """This step's n rows, then row 0 repeated into the pad rows."""
        n = ids.shape[0]
        for static, value in ((self.ids, ids), (self.positions, positions), (self.slots, slots)):
            static[:n].copy_(value)
            static[n:].copy_(value[:1].expand_as(static[n:]))


StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, dict | None], torch.Tensor]


class StaticDecode:
    """The static decode path of one `SlotCache`. `step(ids [B,1], positions [B], slots
    [B], kv_len, lora)` is the dynamic decode forward (plans the cache and returns logits
    [B, 1, V]; `lora`: a decoder LoRA plan or None); `run` calls it over a bucket's
    persistent tensors (and a `StaticAdapter`'s), captured on CUDA."""

    def __init__(self, cache: SlotCache, step: StepFn, max_rows: int, device: torch.device,
                 warmup: int = 3) -> None:
        self.cache, self.step, self.max_rows = cache, step, max_rows
        self.device, self.warmup = device, warmup
        self.capture = device.type == "cuda"
        self.stats = GraphStats()
        self._buckets: dict[tuple, _Bucket] = {}
        self._adapters: dict[tuple, StaticAdapter] = {}  # adapter signature -> its buffers
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._address: int | None = None  # the KV cache's first buffer when the graphs were captured

    def shape(self, rows: int, kv_len: int) -> tuple[int, int] | None:
        """The (batch, KV) bucket of a step, or None when none holds it."""
        b = bucket(rows, self.max_rows)
        kv = bucket(kv_len, self.cache.capacity, KV_MIN)
        return None if b is None or kv is None else (b, kv)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv_len: int,
            version: TorchWeightVersion | None = None) -> torch.Tensor:
        """Logits [n, 1, V] of the n rows, on the base weights or one LoRA `version` for
        every row; the caller checked `shape` is not None."""
        b, kv = self.shape(ids.shape[0], kv_len)
        self._check_address()
        lora, signature = None, None
        if version is not None:
            signature = adapter_signature(version)
            adapter = self._adapters.get(signature) or self._adapters.setdefault(signature, StaticAdapter(version))
            adapter.load(version)
            lora = adapter.plan
        entry = self._buckets.get((b, kv, signature))
        if entry is None:
            entry = self._buckets[(b, kv, signature)] = _Bucket(b, kv, self.device, lora)
        entry.load(ids, positions, slots)
        self.stats.static_steps += 1
        if not self.capture:
            return self.step(entry.ids, entry.positions, entry.slots, kv, lora)[: ids.shape[0]]
        if entry.graph is None:
            self._capture(entry)
        entry.graph.replay()
        self.stats.replays += 1
        return entry.out[: ids.shape[0]].clone()  # the next replay overwrites `out`

    def _check_address(self) -> None:
        """Graphs read the KV buffers by address: drop them when the cache was reallocated."""
        layer = next((lay for lay in self.cache.layers if lay.tensors()), None)
        address = layer.tensors()[0].data_ptr() if layer is not None else None
        if address != self._address:
            if any(e.graph is not None for e in self._buckets.values()):
                self.stats.invalidations += 1
            self._buckets.clear()
            self._address = address

    def _capture(self, entry: _Bucket) -> None:
        """Warm up on a side stream (lazy allocations, library handles), then capture one
        step into the shared pool. Each run writes this step's own K/V: repeating it is
        harmless (the same values into the same places)."""
        start = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.step(entry.ids, entry.positions, entry.slots, entry.kv, entry.lora)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the sampler's worker captures while other threads of the process
            # (a colocated trainer) may use CUDA; only this thread's unsafe calls are errors
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                entry.out = self.step(entry.ids, entry.positions, entry.slots, entry.kv, entry.lora)
        except RuntimeError as e:
            raise RuntimeError(f"CUDA graph capture of the decode step ({entry.rows} rows, KV {entry.kv}) failed; "
                               f"set [sampler.torch] cuda_graphs=false: {e}") from e
        entry.graph = graph
        self.stats.captured += 1
        self.stats.capture_seconds += time.perf_counter() - start
