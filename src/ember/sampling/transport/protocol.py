"""What one weight sync carries, independent of how it travels: the header (`SyncHeader`:
the version, LoRA rank or full, every tensor's name, shape and dtype, the bucket size),
its checks, and how tensors are grouped into buckets and packed into flat buffers
(`bucket_plan`, `pack`, `unpack`). The protocol that sends these is in `channel.py`
(see the package docstring)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch

BUCKET_BYTES = 256 << 20
ALONE_BYTES = 1 << 20  # a tensor this large travels alone, from its own memory (`bucket_plan`)
_ALIGN = 64  # bytes: every tensor in a bucket starts on a cache line
DTYPES = {name: getattr(torch, name) for name in (
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool")}


class WeightSyncError(RuntimeError):
    """A sync could not be completed (peer gone, timed out, protocol error)."""


class WeightSyncRefused(ValueError):
    """A receiver refused a version's header (the message names the tensor); nothing was loaded."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class SyncHeader:
    """What a sync carries, sent before any tensor data (`lora_rank=None`: full weights)."""

    version: str
    lora_rank: int | None
    tensors: tuple[TensorSpec, ...]
    bucket_bytes: int = BUCKET_BYTES

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "SyncHeader":
        """Parse and check a header: a malformed one is a WeightSyncError naming the field."""
        try:
            d = json.loads(raw)
            specs = tuple(_spec(t) for t in d["tensors"])
            header = cls(str(d["version"]), d["lora_rank"], specs, d["bucket_bytes"])
        except (ValueError, KeyError, TypeError) as exc:
            raise WeightSyncError(f"weight sync: malformed header: {exc}") from None
        if header.lora_rank is not None and not (isinstance(header.lora_rank, int) and header.lora_rank >= 1):
            raise WeightSyncError(f"weight sync: header lora_rank must be None or an int >= 1, got {header.lora_rank!r}")
        if not isinstance(header.bucket_bytes, int) or header.bucket_bytes < 1:
            raise WeightSyncError(f"weight sync: header bucket_bytes must be an int >= 1, got {header.bucket_bytes!r}")
        return header


def _spec(t: dict) -> TensorSpec:
    name, shape, dtype = t["name"], t["shape"], t["dtype"]
    if not isinstance(name, str) or dtype not in DTYPES:
        raise ValueError(f"tensor {name!r}: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"tensor {name!r}: shape must be a list of ints >= 0, got {shape!r}")
    return TensorSpec(name, tuple(shape), dtype)


def spec_of(name: str, t: torch.Tensor) -> TensorSpec:
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ValueError(f"weight sync: tensor {name!r} has dtype {t.dtype}, which cannot be synced")
    return TensorSpec(name, tuple(t.shape), dtype)


def bucket_plan(specs: Sequence[TensorSpec], bucket_bytes: int, alone_bytes: int = ALONE_BYTES) -> list[list[int]]:
    """Indices of `specs` grouped, in order, into buckets of at most `bucket_bytes`. A
    tensor of `alone_bytes` or more (or larger than a bucket) is a bucket of its own, sent
    from its own memory: packing it would only add a copy (on a CPU-bound host, packing
    every tensor made the sync 1.5x slower); the many small ones (norms, biases) share
    buckets, so a sync is a few hundred messages, not thousands."""
    buckets: list[list[int]] = []
    size = bucket_bytes + 1  # the first tensor opens a bucket
    for i, s in enumerate(specs):
        if s.nbytes >= min(alone_bytes, bucket_bytes):
            buckets.append([i])
            size = bucket_bytes + 1
            continue
        if size + s.nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += s.nbytes
    return buckets


def layout(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of tensors of these sizes in a flat buffer, each aligned to `_ALIGN` bytes
    (a view as int64 / float32 needs an aligned offset), and the buffer's size."""
    offsets, end = [], 0
    for n in nbytes:
        start = -(-end // _ALIGN) * _ALIGN
        offsets.append(start)
        end = start + n
    return offsets, end


def pack(tensors: Sequence[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """The tensors' bytes, laid out by `layout` in one flat uint8 buffer on `device`."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = layout(sizes)
    flat = torch.zeros(total, dtype=torch.uint8, device=device)  # zeroed padding: nothing stale travels
    for t, offset, n in zip(tensors, offsets, sizes):
        flat[offset:offset + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return flat


def unpack(flat: torch.Tensor, specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
    """Views into `flat` with each spec's dtype and shape (inverse of `pack`)."""
    offsets, _ = layout([s.nbytes for s in specs])
    return [flat[o:o + s.nbytes].view(DTYPES[s.dtype]).view(s.shape) for s, o in zip(specs, offsets)]

