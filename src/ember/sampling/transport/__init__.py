"""Weight transport: how a new weight version reaches a sampler in another process.

`SamplerConfig.weight_sync` chooses the transport once, when a sampler is built
(docs/architecture.md, "The weight path: trainer to sampler"):

* `"files"` (default): the version is written as safetensors (or a peft adapter
  directory) and read back by the sampler.
* `"memory"`: the tensors travel over a torch.distributed group the sender shares with
  the receiver; nothing is written to disk.

The layers, each a module of this package:

* `protocol`: what a sync carries (`SyncHeader`, buckets, packing);
* `channel`: standalone groups and one sync over them (`send_version` / `receive_version`);
* `endpoints`: the trainer's `WeightSender` and a replica's `WeightReceiver`;
* `pool`: a `SamplerPool`'s `WeightTransport` (`FileTransport`, `MemoryTransport` over
  `ReplicaSync`'s channels), chosen by `pool_transport`;
* `engine`: a `VLLMSampler`'s `EngineTransport` into its own engine (imported on use: it
  needs vLLM's modules for the memory one).

The group is *standalone*: a `ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (CUDA) built
directly over its own `TCPStore`, never through `init_process_group`, so it does not touch
the default group a trainer (FSDP) or a replica may already have (vLLM's
`StatelessProcessGroup` and SkyRL's `init_custom_process_group` do the same). Rank 0 is
the sender, holding full tensors (`TrainingEngine.named_weights()` gathers FSDP shards
into full tensors on rank 0); rank 1 is the receiver.

The sender gives each receiver its own 2-rank group (`WeightSender.open`), so a receiver
that dies or stops answering breaks only its own channel: the send to it fails after at
most `timeout_s`, the channel is dropped and reported (`SyncReport.dropped`), the other
receivers get the version, and training goes on. Sends to several receivers run on
threads at once.

Protocol of one sync (every message a collective on the channel's group):

1. header: a JSON `SyncHeader` (version id, LoRA rank or full, every tensor's name,
   shape and dtype, the bucket size), broadcast as a length then bytes;
2. verdict: each receiver checks the header against its model *before any data moves*
   (`sampler_check`: the sampler's own `load_weights` rules on meta tensors) and
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
drops its channel, as with gloo (`nccl_error_handling`). The NCCL paths are written for
GPUs and covered only by GPU-marked tests.

vLLM replicas receive the same way. `VLLMSampler` (with `weight_sync="memory"`) keeps a
full version's tensors in the replica's process and pushes them into its engine through
vLLM's weight-transfer API whenever its `WeightGate` swaps that version in
(`engine.MemoryEngineTransport`, `ember.sampling.vllm_weight_engine`); a LoRA version is
written as an adapter directory, because vLLM 0.32 takes adapters only from a path
(`LoRARequest.lora_path`).
"""

from ember.sampling.config import WEIGHT_SYNC_MODES
from ember.sampling.transport.channel import (IN_FLIGHT, MAX_HEADER_BYTES, NCCL_ERROR_HANDLING, Channel,
                                              ChannelAddress, channel_device, join_channel, nccl_error_handling,
                                              open_channel, receive_version, send_version, sync_backend)
from ember.sampling.transport.endpoints import (SyncReport, WeightReceiver, WeightSender, distinct_tensors,
                                                sampler_check)
from ember.sampling.transport.pool import (FileTransport, MemoryTransport, ReplicaSync, WeightTransport,
                                           pool_transport, sync_host)
from ember.sampling.transport.protocol import (ALONE_BYTES, BUCKET_BYTES, DTYPES, SyncHeader, TensorSpec,
                                               WeightSyncError, WeightSyncRefused, bucket_plan, layout, pack,
                                               spec_of, unpack)

__all__ = [
    "ALONE_BYTES", "BUCKET_BYTES", "DTYPES", "IN_FLIGHT", "MAX_HEADER_BYTES", "NCCL_ERROR_HANDLING", "WEIGHT_SYNC_MODES",
    "Channel", "ChannelAddress", "FileTransport", "MemoryTransport", "ReplicaSync", "SyncHeader", "SyncReport",
    "TensorSpec", "WeightReceiver", "WeightSender", "WeightSyncError", "WeightSyncRefused", "WeightTransport",
    "bucket_plan", "channel_device", "distinct_tensors", "join_channel", "layout", "nccl_error_handling",
    "open_channel", "pack", "pool_transport", "receive_version", "sampler_check", "send_version", "spec_of",
    "sync_backend", "sync_host", "unpack",
]
