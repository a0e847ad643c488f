"""The two ends of weight sync: `WeightSender` (the trainer's side: one channel per
receiver, sent to at once, a failing receiver dropped) and `WeightReceiver` (a
replica's side), plus the receiver's header check against a sampler's model
(`sampler_check`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ember.sampling.base import Sampler, WeightVersion
from ember.sampling.transport.channel import (Channel, ChannelAddress, channel_device, join_channel,
                                              open_channel, receive_version, send_version)
from ember.sampling.transport.protocol import BUCKET_BYTES, DTYPES, SyncHeader, WeightSyncRefused

log = logging.getLogger(__name__)


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

    def receive_into(self, sampler: Sampler) -> tuple[str, WeightVersion]:
        """Receive one version and load it into `sampler` (checked against its model before
        any data moves); returns (the sender's version id, the sampler's WeightVersion)."""
        from tinker import types

        header, named = receive_version(self.channel, sampler_check(sampler))
        lora = types.LoraConfig(rank=header.lora_rank) if header.lora_rank is not None else None
        # copy=False: the tensors are views of buckets nobody else holds
        return header.version, sampler.load_weights(named, lora, copy=False)


def sampler_check(sampler: Sampler) -> Callable[[SyncHeader], None] | None:
    """The header check of a sampler that holds an `nn.Module` (TorchSampler): its own
    `load_weights` rules applied to meta tensors of the header's shapes, so a refusal has
    the same message (naming the tensor) as a direct load would. Other backends check the
    tensors when they load them (after the transfer, still before anything is served)."""
    model = sampler.model
    if model is None:
        return None
    from tinker import types

    from ember.sampling.weights import build_full_version, build_lora_version, parameter_aliases

    meta = torch.device("meta")

    def check(header: SyncHeader) -> None:
        items = [(s.name, torch.empty(s.shape, dtype=DTYPES[s.dtype], device=meta)) for s in header.tensors]
        if header.lora_rank is None:
            build_full_version(-1, items, parameter_aliases(model), meta, torch.float32, copy=False,
                               model_config=model.config)
        else:
            build_lora_version(-1, model, items, types.LoraConfig(rank=header.lora_rank), meta, torch.float32, False)

    return check

