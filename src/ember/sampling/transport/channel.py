"""How a sync travels: standalone 2-rank torch.distributed groups (`open_channel` on the
sender, `join_channel` on the receiver), bounded by a timeout, and the protocol of one
sync over such a channel (`send_version` / `receive_version`: header, verdict, buckets;
see the package docstring)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ember.sampling.scoped_env import scoped_env
from ember.sampling.transport.protocol import (BUCKET_BYTES, SyncHeader, WeightSyncError, WeightSyncRefused,
                                               bucket_plan, layout, pack, spec_of, unpack)

IN_FLIGHT = 4  # sends started before the oldest is waited for
MAX_HEADER_BYTES = 64 << 20  # names and shapes of even a huge model fit; a hostile length does not
_STORE_PREFIX = "ember-weight-sync"


@dataclass(frozen=True)
class ChannelAddress:
    """Where a receiver joins its channel (rank 1 of a 2-rank group; the sender is rank 0)."""

    host: str
    port: int
    backend: str = "gloo"
    timeout_s: float = 60.0


def _new_group(store: dist.Store, host: str, rank: int, world: int, backend: str, timeout_s: float):
    timeout = timedelta(seconds=timeout_s)
    store = dist.PrefixStore(_STORE_PREFIX, store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        # Bound to the channel's own address, so traffic stays on the interface it names.
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, world, opts)
    if backend == "nccl":  # pragma: no cover - CUDA only (GPU-marked tests)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        with nccl_error_handling():
            return dist.ProcessGroupNCCL(store, rank, world, opts)
    raise ValueError(f"weight sync backend must be 'gloo' or 'nccl', got {backend!r}")


# How a ProcessGroupNCCL handles a collective that timed out: read from the environment when
# the group is built. 2 ("CleanUpOnly"): abort the communicator and fail the work, leaving
# the process alive; torch's default (3) ends the process, which would take the trainer
# down with one dead receiver.
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def nccl_error_handling():
    """`NCCL_ERROR_HANDLING` set while a weight-sync group is built (the caller's value back
    after; one at a time): only these standalone groups get it, not the trainer's own."""
    name, value = NCCL_ERROR_HANDLING
    with scoped_env(_ENV_LOCK, name, value):
        yield


def channel_device(backend: str, device: torch.device | str | None) -> torch.device:
    """Where one end's buffers live: the host for gloo; for NCCL the CUDA device this end
    was given ("cuda" alone: device 0 of the process, where it and each of its threads
    start). Never the thread's current device (see the module docstring)."""
    if backend != "nccl":
        return torch.device("cpu")
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda":
        raise ValueError(f"weight sync over NCCL needs this end's CUDA device (e.g. 'cuda:1'), got {device!r}: "
                         "a channel's threads do not share the caller's current device")
    return torch.device("cuda", dev.index or 0)


def sync_backend(sender_device: str | None, receiver_devices: Sequence[str | None]) -> str:
    """The channel backend between a sender on `sender_device` and receivers on
    `receiver_devices`: NCCL when every end is on a CUDA device of its own, else gloo
    (a receiver on the CPU, or on the sender's own GPU, where NCCL refuses two ranks)."""
    from ember.engine.config import cuda_index

    sender = cuda_index(sender_device)
    receivers = [cuda_index(d) for d in receiver_devices]
    if sender is None or not receivers or any(r is None or r == sender for r in receivers):
        return "gloo"
    return "nccl"


class Channel:
    """One side of a sender-receiver group; every operation bounded by `timeout_s`.
    `device`: this end's CUDA device for NCCL (`channel_device`); gloo uses the host."""

    def __init__(self, store: dist.TCPStore, group, rank: int, backend: str, timeout_s: float,
                 device: torch.device | str | None = None) -> None:
        self.store, self.group, self.rank, self.timeout_s = store, group, rank, timeout_s
        self.device = channel_device(backend, device)
        self.syncs = 0

    def _wait(self, work) -> None:
        if not work.wait(timedelta(seconds=self.timeout_s)):
            raise WeightSyncError(f"weight sync: peer did not answer within {self.timeout_s} s")

    def broadcast(self, t: torch.Tensor) -> None:
        self._wait(self.broadcast_async(t))

    def broadcast_async(self, t: torch.Tensor):
        """Start a broadcast from rank 0; `wait(work)` finishes it (keep `t` alive until then)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self.group.broadcast([t], opts)

    def wait(self, work) -> None:
        self._wait(work)

    def max(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._wait(self.group.allreduce([t], opts))
        return int(t.item())

    def broadcast_bytes(self, raw: bytes | None) -> bytes:
        n = torch.tensor([len(raw) if raw is not None else 0], dtype=torch.int64, device=self.device)
        self.broadcast(n)
        size = int(n.item())
        if size > MAX_HEADER_BYTES:
            raise WeightSyncError(f"weight sync: header of {size} bytes is over the {MAX_HEADER_BYTES} limit")
        buf = (torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device) if raw is not None
               else torch.empty(size, dtype=torch.uint8, device=self.device))
        self.broadcast(buf)
        return bytes(buf.cpu().numpy())


def open_channel(host: str = "127.0.0.1", backend: str = "gloo", timeout_s: float = 60.0,
                 device: torch.device | str | None = None):
    """Sender side: listen on a free port of `host`; returns (address, connect) where
    `connect()` blocks until the receiver joined (at most `timeout_s`) and gives the Channel
    (on `device`, this end's CUDA device for NCCL; `connect` may run on any thread)."""
    device = channel_device(backend, device)  # refused here, in the caller, not on a join thread
    store = dist.TCPStore(host, 0, 2, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    address = ChannelAddress(host, store.port, backend, timeout_s)

    def connect() -> Channel:
        try:
            group = _new_group(store, host, 0, 2, backend, timeout_s)
        except Exception as exc:  # noqa: BLE001 - rendezvous failures vary by backend
            raise WeightSyncError(f"weight sync: receiver did not join {host}:{address.port}: {exc}") from exc
        return Channel(store, group, 0, backend, timeout_s, device)

    return address, connect


def join_channel(address: ChannelAddress, device: torch.device | str | None = None) -> Channel:
    """Receiver side: join the channel a sender opened (blocks until the rendezvous is done);
    `device`: this end's CUDA device when the channel is NCCL (`channel_device`)."""
    device = channel_device(address.backend, device)
    timeout = timedelta(seconds=address.timeout_s)
    store = dist.TCPStore(address.host, address.port, 2, is_master=False, timeout=timeout)
    group = _new_group(store, address.host, 1, 2, address.backend, address.timeout_s)
    return Channel(store, group, 1, address.backend, address.timeout_s, device)


def send_version(channel: Channel, named: Sequence[tuple[str, torch.Tensor]], version: str,
                 lora_rank: int | None = None, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sender side of one sync over `channel` (see the module docstring for the protocol)."""
    header = SyncHeader(version, lora_rank, tuple(spec_of(n, t) for n, t in named), bucket_bytes)
    seq = channel.syncs
    channel.syncs += 1
    channel.broadcast_bytes(header.to_bytes())
    if channel.max(0):
        key = f"refused/{seq}"
        reason = channel.store.get(key).decode() if channel.store.check([key]) else "no reason given"
        raise WeightSyncRefused(f"weight sync of version {version!r} refused by the receiver: {reason}")
    in_flight: list = []  # (work, buffer): the next bucket is packed while the last one travels
    for bucket in bucket_plan(header.tensors, bucket_bytes):
        buf = _bucket_buffer([named[i][1] for i in bucket], channel.device)
        in_flight.append((channel.broadcast_async(buf), buf))
        if len(in_flight) > IN_FLIGHT:
            channel.wait(in_flight.pop(0)[0])
    for work, _ in in_flight:
        channel.wait(work)


def _bucket_buffer(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A bucket's bytes: a lone contiguous tensor already on `device` travels as it is (no
    copy; the big embedding matrices), several are packed into one flat buffer."""
    if len(tensors) == 1:
        t = tensors[0].detach()
        if t.is_contiguous() and t.device == device and t.numel():
            return t.reshape(-1).view(torch.uint8)
    return pack(tensors, device)


def receive_version(channel: Channel, check: Callable[[SyncHeader], None] | None = None
                    ) -> tuple[SyncHeader, list[tuple[str, torch.Tensor]]]:
    """Receiver side of one sync: the header and the (name, tensor) pairs, tensors being
    views into the received buckets. `check(header)` raises ValueError naming a tensor the
    model cannot take; the refusal is sent back and raised here as `WeightSyncRefused`."""
    seq = channel.syncs
    channel.syncs += 1
    header = SyncHeader.from_bytes(channel.broadcast_bytes(None))
    reason = None
    try:
        if check is not None:
            check(header)
    except ValueError as exc:
        reason = str(exc)
        channel.store.set(f"refused/{seq}", reason)
    if channel.max(1 if reason is not None else 0):
        raise WeightSyncRefused(f"weight sync of version {header.version!r} refused: {reason}")
    named: list[tuple[str, torch.Tensor]] = []
    works = []  # every bucket's receive is queued at once: allocation overlaps the transfer
    for bucket in bucket_plan(header.tensors, header.bucket_bytes):
        specs = [header.tensors[i] for i in bucket]
        flat = torch.empty(layout([s.nbytes for s in specs])[1], dtype=torch.uint8, device=channel.device)
        works.append(channel.broadcast_async(flat))
        named.extend((s.name, t) for s, t in zip(specs, unpack(flat, specs)))
    for work in works:
        channel.wait(work)
    return header, named

