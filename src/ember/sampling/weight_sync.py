"""Weights in memory: the seam between the trainer and sampler replicas in other processes.

`SamplerConfig.weight_sync` chooses how a new weight version reaches a sampler that runs
in another process (docs/architecture.md, "The weight path: trainer to sampler"):

* `"files"` (default): today's path: the version is written as safetensors (or a peft
  adapter directory) and read back by the sampler.
* `"memory"`: the trainer broadcasts the tensors over a torch.distributed group it shares
  with the replica; nothing is written to disk.

The group is *standalone*: a `ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (CUDA) built
directly over its own `TCPStore`, never through `init_process_group`, so it does not touch
the default group a trainer (FSDP) or a replica may already have (vLLM's
`StatelessProcessGroup` and SkyRL's `init_custom_process_group` do the same). Rank 0 is
the sender; ranks 1..n are receivers. The sender is the trainer's rank 0 holding full
tensors (`TrainingEngine.named_weights()` already gathers FSDP shards into full tensors
on rank 0), or every FSDP rank sending its own shard: each trainer rank holds its own
channel to the receiver (`GroupEngine.open_shard_sync` / `send_weight_shards`), sends
`rank_part` of each tensor (its dim-0 rows of an FSDP2 DTensor; a replicated or plain
tensor from rank 0 only), and a `ShardReceiver` joins one channel per rank and
concatenates the parts in rank order (`assemble_shards`): no rank gathers the version.
A shard's shape is not the model's, so that receiver checks the names and shapes when it
loads the assembled tensors (the sampler's `load_weights` refuses a misfit naming the
tensor), after the transfer rather than before it.

The sender gives each receiver its own 2-rank group (`WeightSender.open`), so a receiver
that dies or stops answering breaks only its own channel: the send to it fails after at
most `timeout_s`, the channel is dropped and reported (`SyncReport.dropped`), the other
receivers get the version, and training goes on. Sends to several receivers run on
threads at once.

Protocol of one sync (every message a collective on the channel's group):

1. header: a JSON `SyncHeader` (version id, LoRA rank or full, every tensor's name,
   shape and dtype, the bucket size), broadcast as a length then bytes;
2. verdict: each receiver checks the header against its model *before any data moves*
   (`check_torch_sampler`: the sampler's own `load_weights` rules on meta tensors) and
   answers with an all-reduce(MAX) of 0 (accepted) or 1 (refused); a refusing receiver
   leaves its message, which names the tensor, in the store, and the sender raises
   `WeightSyncRefused` with it. Nothing is loaded: never a silent partial load;
3. buckets: the small tensors packed into flat uint8 buffers of at most `bucket_bytes`
   (256 MiB), each tensor of 1 MiB or more sent alone from its own memory
   (`bucket_plan`), broadcast in header order, a few in flight; the receiver unpacks views
   into each bucket (no copy) and hands the whole set to
   `Sampler.load_weights(..., copy=False)` once every bucket arrived.

CUDA: `backend="nccl"` builds a `ProcessGroupNCCL` with the buckets on the GPU (the
receiver then loads from GPU tensors). Each end names its own device (`device=`, checked by
`channel_device`), never `torch.cuda.current_device()`: channels are built and used on
threads of their own, and a new thread's current device is cuda:0 whatever its process set,
so a trainer on cuda:0 and a replica on cuda:1 would both put their rank on cuda:0, which
NCCL refuses. `sync_backend` picks gloo (through host memory) for a replica on the sender's
own GPU, where NCCL cannot have two ranks. A timed-out NCCL channel must not take the
process down: its group is built with `TORCH_NCCL_ASYNC_ERROR_HANDLING=2` (abort the
communicator only; torch's default tears the process down) so that a dead receiver only
drops its channel, as with gloo (`nccl_error_handling`). `cuda_ipc_handles` /
`open_cuda_ipc_handles` are the colocated path (a replica on the trainer's own GPU maps the trainer's tensors through CUDA
IPC, no copy through the host). Both are written for GPUs and covered only by GPU-marked
tests.

vLLM replicas receive the same way. `VLLMSampler` (with `weight_sync="memory"`) keeps a
full version's tensors in the replica's process and pushes them into its engine through
vLLM's weight-transfer API whenever its `WeightGate` swaps that version in
(`ember.sampling.vllm_weight_engine`); a LoRA version is written as an adapter directory,
because vLLM 0.32 takes adapters only from a path (`LoRARequest.lora_path`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ember.sampling.scoped_env import scoped_env
from ember.sampling.config import WEIGHT_SYNC_MODES  # noqa: F401 - re-exported; its home is the config

log = logging.getLogger(__name__)

BUCKET_BYTES = 256 << 20
ALONE_BYTES = 1 << 20  # a tensor this large travels alone, from its own memory (`bucket_plan`)
_ALIGN = 64  # bytes: every tensor in a bucket starts on a cache line
IN_FLIGHT = 4  # sends started before the oldest is waited for
MAX_HEADER_BYTES = 64 << 20  # names and shapes of even a huge model fit; a hostile length does not
_DTYPES = {name: getattr(torch, name) for name in (
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool")}
_STORE_PREFIX = "ember-weight-sync"


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
        return n * _DTYPES[self.dtype].itemsize


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
    if not isinstance(name, str) or dtype not in _DTYPES:
        raise ValueError(f"tensor {name!r}: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"tensor {name!r}: shape must be a list of ints >= 0, got {shape!r}")
    return TensorSpec(name, tuple(shape), dtype)


def spec_of(name: str, t: torch.Tensor) -> TensorSpec:
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
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
    return [flat[o:o + s.nbytes].view(_DTYPES[s.dtype]).view(s.shape) for s, o in zip(specs, offsets)]


# ---------------------------------------------------------------------- standalone groups
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


# ---------------------------------------------------------------------- one sync, both sides
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


# ---------------------------------------------------------------------- trainer and replica ends
@dataclass
class SyncReport:
    """Outcome of `WeightSender.send`: who got the version, who was dropped and why."""

    version: str
    seconds: float
    delivered: list[str]
    dropped: dict[str, str]


class WeightSender:
    """Trainer side (rank 0 with full tensors): one channel per receiver, sent to at once.

    `open(receiver_id)` listens for a new receiver and returns the address it must
    `WeightReceiver(address)` join; `send` pushes one version to every open receiver. A
    receiver that fails or times out is dropped (its channel closed) and reported in the
    returned `SyncReport`; `send` itself returns within about `timeout_s` whatever the
    receivers do. A refusal (the header does not fit a receiver's model) raises
    `WeightSyncRefused` naming the tensor; the channel stays usable.
    """

    def __init__(self, host: str = "127.0.0.1", backend: str = "gloo", timeout_s: float = 60.0,
                 bucket_bytes: int = BUCKET_BYTES, device: torch.device | str | None = None) -> None:
        self.host, self.backend, self.timeout_s, self.bucket_bytes = host, backend, timeout_s, bucket_bytes
        self.device = channel_device(backend, device)  # every channel's end: the caller's device
        self._channels: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._version = 0

    @property
    def receivers(self) -> list[str]:
        with self._lock:
            return sorted(self._channels)

    def open(self, receiver_id: str) -> ChannelAddress:
        address, connect = open_channel(self.host, self.backend, self.timeout_s, self.device)
        with self._lock:
            if receiver_id in self._channels:
                raise ValueError(f"weight sync: receiver {receiver_id!r} already has a channel")
            self._channels[receiver_id] = _Pending(connect)
        return address

    def wait_joined(self, receiver_id: str, timeout: float | None = None) -> bool:
        """Whether the receiver has joined its channel (waiting at most `timeout`)."""
        with self._lock:
            pending = self._channels.get(receiver_id)
        return pending is not None and pending.joined(timeout)

    def drop(self, receiver_id: str) -> None:
        with self._lock:
            self._channels.pop(receiver_id, None)  # its group and store go with the last reference

    def send(self, named_weights: Iterable[tuple[str, torch.Tensor]], version: str | None = None,
             lora_rank: int | None = None, only: Iterable[str] | None = None) -> SyncReport:
        """Push one version to every receiver (or those named in `only`)."""
        start = time.monotonic()
        named = distinct_tensors(named_weights)
        if version is None:
            self._version += 1
            version = str(self._version)
        with self._lock:
            targets = {rid: p for rid, p in self._channels.items() if only is None or rid in set(only)}
        runs = {rid: _in_thread(self._send_one, p, named, version, lora_rank) for rid, p in targets.items()}
        delivered, dropped, refused = [], {}, []
        deadline = start + 2 * self.timeout_s + 5  # the rendezvous plus the transfer, each bounded
        for rid, fut in runs.items():
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
                delivered.append(rid)
            except WeightSyncRefused as exc:
                refused.append(str(exc))
            except Exception as exc:  # noqa: BLE001 - any failure drops the receiver, never training
                dropped[rid] = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                self.drop(rid)
                log.warning("weight sync: receiver %s dropped: %s", rid, dropped[rid])
        if refused:
            raise WeightSyncRefused(refused[0])
        return SyncReport(version, time.monotonic() - start, delivered, dropped)

    def _send_one(self, pending: "_Pending", named, version: str, lora_rank: int | None) -> None:
        send_version(pending.channel(), named, version, lora_rank, self.bucket_bytes)

    def close(self) -> None:
        with self._lock:
            self._channels.clear()


def distinct_tensors(named_weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The pairs, each tensor once: tied aliases (a state_dict's `lm_head.weight` that is
    `embed_tokens.weight`) are the same memory, and the receiver's model ties them again."""
    seen: set[tuple] = set()
    out = []
    for n, t in named_weights:
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out.append((n, t))
    return out


class _Pending:
    """A channel whose receiver may not have joined yet (the rendezvous runs on a thread from
    `open` on, so it overlaps the replica's start-up); one send at a time."""

    def __init__(self, connect: Callable[[], Channel]) -> None:
        from concurrent.futures import Future

        self._joined: Future = Future()
        self.lock = threading.Lock()

        def run() -> None:
            try:
                self._joined.set_result(connect())
            except BaseException as exc:  # noqa: BLE001 - raised by channel()
                self._joined.set_exception(exc)

        threading.Thread(target=run, name="ember-weight-sync-join", daemon=True).start()

    def channel(self) -> Channel:
        return self._joined.result()  # connect() itself gives up after timeout_s

    def joined(self, timeout: float | None = None) -> bool:
        try:
            self._joined.result(timeout)
            return True
        except Exception:  # noqa: BLE001 - not joined (yet), whatever the reason
            return False


def _in_thread(fn, pending: _Pending, *args):
    """Run fn(pending, *args) on a daemon thread (one at a time per channel); a Future of it.
    Daemon: a send stuck in a dead peer's socket must not keep the process alive."""
    from concurrent.futures import Future

    fut: Future = Future()

    def run() -> None:
        try:
            with pending.lock:
                fut.set_result(fn(pending, *args))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            fut.set_exception(exc)

    threading.Thread(target=run, name="ember-weight-sync", daemon=True).start()
    return fut


class WeightReceiver:
    """Replica side: joins the channel at `address` (on `device`, the replica's CUDA device
    for NCCL); `receive_into(sampler)` takes one version."""

    def __init__(self, address: ChannelAddress, device: torch.device | str | None = None) -> None:
        self.channel = join_channel(address, device)

    def receive(self, check: Callable[[SyncHeader], None] | None = None):
        return receive_version(self.channel, check)

    def receive_into(self, sampler):
        """Receive one version and load it into `sampler` (checked against its model before
        any data moves); returns (the sender's version id, the sampler's WeightVersion)."""
        from tinker import types

        header, named = receive_version(self.channel, sampler_check(sampler))
        lora = types.LoraConfig(rank=header.lora_rank) if header.lora_rank is not None else None
        # copy=False: the tensors are views of buckets nobody else holds
        return header.version, sampler.load_weights(named, lora, copy=False)


def sampler_check(sampler) -> Callable[[SyncHeader], None] | None:
    """The header check of a sampler that holds an `nn.Module` (TorchSampler): its own
    `load_weights` rules applied to meta tensors of the header's shapes, so a refusal has
    the same message (naming the tensor) as a direct load would. Other backends check the
    tensors when they load them (after the transfer, still before anything is served)."""
    model = getattr(sampler, "model", None)
    if not isinstance(model, torch.nn.Module):
        return None
    from tinker import types

    from ember.sampling.weights import build_full_version, build_lora_version, parameter_aliases

    meta = torch.device("meta")

    def check(header: SyncHeader) -> None:
        items = [(s.name, torch.empty(s.shape, dtype=_DTYPES[s.dtype], device=meta)) for s in header.tensors]
        if header.lora_rank is None:
            build_full_version(-1, items, parameter_aliases(model), meta, torch.float32, copy=False,
                               model_config=model.config)
        else:
            build_lora_version(-1, model, items, types.LoraConfig(rank=header.lora_rank), meta, torch.float32, False)

    return check


# ---------------------------------------------------------------------- FSDP ranks, each its shard
def rank_part(t: torch.Tensor, rank: int) -> torch.Tensor | None:
    """What trainer rank `rank` sends of `t` when every rank sends its own shard: of a
    DTensor sharded on dim 0 over a 1-D mesh (FSDP2's layout), its local rows (possibly
    none); a replicated DTensor or a plain tensor whole from rank 0, nothing from the
    others. Other layouts (TP's 2-D meshes, a shard on another dim) raise ValueError:
    those are sent gathered (`named_weights`)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(t, DTensor):
        return t.detach() if rank == 0 else None
    placements, mesh = tuple(t.placements), t.device_mesh
    if mesh.ndim != 1 or mesh.get_local_rank() != rank:
        raise ValueError(f"per-rank weight sync needs a 1-D mesh over the ranks in order (FSDP); got a "
                         f"{mesh.ndim}-D mesh where rank {rank} has coordinate {mesh.get_local_rank()}")
    if isinstance(placements[0], Replicate):
        return t.to_local().detach() if rank == 0 else None
    if isinstance(placements[0], Shard) and placements[0].dim == 0:
        return t.to_local().detach()
    raise ValueError(f"per-rank weight sync sends dim-0 shards or replicated tensors, got placements {placements}")


def assemble_shards(parts: Sequence[Sequence[tuple[str, torch.Tensor]]]) -> list[tuple[str, torch.Tensor]]:
    """The receiver's inverse of `rank_part`: `parts[r]` is what rank r sent; each name's
    pieces are joined on dim 0 in rank order (a name that one rank sent: that tensor)."""
    pieces: dict[str, list[torch.Tensor]] = {}
    for named in parts:
        for name, t in named:
            pieces.setdefault(name, []).append(t)
    return [(name, ts[0] if len(ts) == 1 else torch.cat(ts, 0)) for name, ts in pieces.items()]


class ShardReceiver:
    """Replica side of per-rank sending: one channel per trainer rank (`addresses` in rank
    order, from `GroupEngine.open_shard_sync`); `receive()` takes one version from all."""

    def __init__(self, addresses: Sequence[ChannelAddress], device: torch.device | str | None = None) -> None:
        if not addresses:
            raise ValueError("per-rank weight sync: no trainer rank to receive from")
        self.channels = [join_channel(a, device) for a in addresses]  # each rank's connect waits on a thread

    def receive(self) -> tuple[SyncHeader, list[tuple[str, torch.Tensor]]]:
        """One version: every rank's part received at once, then assembled. The header
        returned carries the version and LoRA rank (which every rank must agree on)."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(self.channels), thread_name_prefix="ember-shard-sync") as pool:
            got = list(pool.map(receive_version, self.channels))
        first = got[0][0]
        for rank, (header, _) in enumerate(got):
            if (header.version, header.lora_rank) != (first.version, first.lora_rank):
                raise WeightSyncError(f"per-rank weight sync: rank {rank} sent version {header.version!r} "
                                      f"(LoRA rank {header.lora_rank}), rank 0 version {first.version!r} "
                                      f"(LoRA rank {first.lora_rank})")
        return first, assemble_shards([named for _, named in got])


# ---------------------------------------------------------------------- a pool's replicas
class ReplicaSync:
    """A `SamplerPool`'s memory mode: one channel per replica slot, the live versions' tensors
    kept in this (the trainer's) process so that a replacement replica can be synced too.

    The pool calls `attach` when a replica starts, `push` to load a version on some of its
    replicas (each receives through the `ReplicaHost.receive_weights` op), `forget` when a
    version's last handle is gone, and `detach` when a replica is taken out. `push` returns
    within about `timeout_s` whatever the replicas do; the failed ones are returned so the
    pool takes them out (a sync never blocks training).
    """

    def __init__(self, host: str, timeout_s: float, backend: str = "gloo",
                 device: torch.device | str | None = None) -> None:
        self.sender = WeightSender(host, backend, timeout_s, device=device)
        self.timeout_s = timeout_s
        self._versions: dict[int, tuple[list[tuple[str, torch.Tensor]], int | None]] = {}
        self._lock = threading.Lock()
        self._pushing = threading.Lock()

    def keep(self, key: int, named_weights: Iterable[tuple[str, torch.Tensor]], lora_rank: int | None,
             copy: bool = True) -> int:
        """Hold version `key`'s tensors (each distinct one once); their bytes. `copy`: as
        `Sampler.load_weights` (False only when the caller never writes to them again)."""
        named = distinct_tensors((n, t.detach()) for n, t in named_weights)
        if copy:  # a version is immutable: the caller's live parameters must not show through
            named = [(n, t.clone()) for n, t in named]
        with self._lock:
            self._versions[key] = (named, lora_rank)
        return sum(t.numel() * t.element_size() for _, t in named)

    def kept(self, key: int) -> dict[str, torch.Tensor]:
        """Version `key`'s kept tensors by name (read-only: for inspection and tests)."""
        with self._lock:
            return dict(self._versions[key][0])

    def forget(self, keys: Iterable[int]) -> None:
        with self._lock:
            for key in keys:
                self._versions.pop(key, None)

    def attach(self, index: int, replica) -> None:
        """Open slot `index`'s channel and have its (new) replica join it."""
        self.detach(index)
        replica.call("join_weight_sync", self.sender.open(_rid(index)))  # a failed join fails the next push

    def detach(self, index: int) -> None:
        self.sender.drop(_rid(index))

    def push(self, replicas: dict[int, object], key: int) -> tuple[list[int], dict[int, str]]:
        """Send version `key` to `replicas` (slot index -> Replica); (slots that loaded it,
        {slot: why it failed}). A refusal raises `WeightSyncRefused` (the weights' fault)."""
        with self._lock:
            named, lora_rank = self._versions[key]
        with self._pushing:  # one push at a time: a replica's receives then meet the sends in order
            calls = {i: r.call("receive_weights") for i, r in replicas.items()}
            report = self.sender.send(named, str(key), lora_rank, only=[_rid(i) for i in replicas])
        failed = {int(rid.rsplit("-", 1)[1]): why for rid, why in report.dropped.items()}
        loaded = []
        for i, fut in calls.items():
            if i in failed:
                continue
            try:
                fut.result(self.timeout_s)
                loaded.append(i)
            except Exception as exc:  # noqa: BLE001 - that replica's fault: the pool replaces it
                failed[i] = f"{type(exc).__name__}: {exc}"
        return loaded, failed

    def close(self) -> None:
        self.sender.close()
        with self._lock:
            self._versions.clear()


def _rid(index: int) -> str:
    return f"replica-{index}"


def sync_host(placement: str) -> str:
    """The address replicas reach the trainer's channels on: loopback for local replicas,
    this node's IP on a Ray cluster (the replicas may be on other nodes)."""
    if placement == "ray":
        import ray

        return ray.util.get_node_ip_address()
    return "127.0.0.1"


# ---------------------------------------------------------------------- colocated: CUDA IPC
def cuda_ipc_handles(named_weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple]]:
    """Colocated replica (`SamplerConfig.colocate`: the trainer's own GPU): picklable CUDA IPC
    handles of the tensors instead of their bytes (`reduce_tensor`, as vLLM's `ipc` engine
    and verl do). The sender keeps the tensors alive until the receiver has opened them.
    CUDA only; GPU-marked test."""
    from torch.multiprocessing.reductions import reduce_tensor

    out = []
    for name, t in distinct_tensors(named_weights):
        if not t.is_cuda:
            raise ValueError(f"weight sync: CUDA IPC needs CUDA tensors; {name!r} is on {t.device}")
        out.append((name, reduce_tensor(t.detach().contiguous())))
    return out


def open_cuda_ipc_handles(handles: Sequence[tuple[str, tuple]]) -> list[tuple[str, torch.Tensor]]:
    """The receiver's side: each handle mapped and copied on the GPU (the trainer writes its
    tensors again at the next optimizer step; nothing goes through the host)."""
    return [(name, rebuild(*args).clone()) for name, (rebuild, args) in handles]
