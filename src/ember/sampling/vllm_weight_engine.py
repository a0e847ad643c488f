"""An `ember_gloo` weight-transfer engine for vLLM (CPU): ember's memory sync into vLLM's worker.

vLLM 0.32 builds a `WeightTransferEngine` in each worker when the engine is started with a
`weight_transfer_config` (`WeightTransferEngineFactory.create_engine`, called from
`Worker.load_model`, which vLLM's `CPUWorker` inherits), and drives it through
`AsyncLLM.init_weight_transfer_engine(init_info)` / `start_weight_update` /
`update_weights(update_info)` / `finish_weight_update`. Its own backends are CUDA-only
(`nccl`, `ipc`, ...), and the base class's `update_weights` ends with
`torch.accelerator.synchronize()`, which raises "Cannot access accelerator device when
none is available" on a CPU build. This engine joins an `ember.sampling.transport`
channel (a standalone gloo group) and loads what it receives with the model's own
`load_weights`, without that synchronize.

`VLLMSampler` uses it with `SamplerConfig.weight_sync="memory"` (its `MemoryEngineTransport`:
`engine_options`, `WeightPusher`): a full version kept in the sampler's process is pushed into its engine
when requests pinned to it run (`WeightGate`), with no file. On CUDA the engine shares the
sampler's GPU, so the push is vLLM's own `ipc` engine (CUDA IPC handles of the kept
tensors, no copy through the host); vLLM's `nccl` engine would need the sender on another
GPU (NCCL refuses two ranks on one device), which is the trainer-to-replica hop
(`ember.sampling.transport.pool`), not this one. The CUDA push is written and GPU-marked only.

`register()` adds the gloo engine to vLLM's factory under `ENGINE_NAME`. It must run in the process
that builds the worker (vLLM's engine core, which vLLM starts with `spawn`, so nothing
registered in the parent is there): the engine is started with
`worker_extension_cls=WORKER_EXTENSION`, vLLM imports this module in the worker before it
loads the model, and the import registers the engine.
"""

from __future__ import annotations

import asyncio
import base64
import os
import pickle
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

ENGINE_NAME = "ember_gloo"
WORKER_EXTENSION = "ember.sampling.vllm_weight_engine.EmberWorkerExtension"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    host: str
    port: int
    timeout_s: float = 60.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    version: str = ""


class EmberGlooEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        from ember.sampling.transport import ChannelAddress, WeightReceiver

        self.receiver = WeightReceiver(ChannelAddress(init_info.host, init_info.port, "gloo", init_info.timeout_s))
        self.received: list[str] = []

    def start_weight_update(self) -> None:
        """Weights arrive in checkpoint (HF) format: vLLM's layerwise reload restores the
        loaders its CPU build replaced when it repacked the weights (as its `nccl` engine does)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        header, named = self.receiver.receive()
        if update_info.version and header.version != update_info.version:
            raise ValueError(f"weight sync: expected version {update_info.version!r}, received {header.version!r}")
        self.model.load_weights(weights=named)
        self.received.append(header.version)

    def shutdown(self) -> None:
        self.receiver = None


def engine_options(device: str) -> dict:
    """`AsyncEngineArgs` options of an engine that takes versions through `WeightPusher`."""
    if device == "cpu":
        return {"weight_transfer_config": {"backend": ENGINE_NAME}, "worker_extension_cls": WORKER_EXTENSION}
    # vLLM refuses pickled IPC handles otherwise; they come from this process only (the
    # engine core's socket is local to it)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return {"weight_transfer_config": {"backend": "ipc"}}


class WeightPusher:
    """The sampler's side of its engine's weight-transfer engine: `init(llm)` once per
    engine, then `push(llm, tensors, tag)` loads a full version (HF names) into it in place.
    Runs on the sampler's event loop; a failed push raises RuntimeError (category server)."""

    def __init__(self, device: str, timeout_s: float) -> None:
        self.device, self.timeout_s = device, timeout_s
        self._sender = None

    async def init(self, llm) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        if self.device != "cpu":  # pragma: no cover - CUDA only (GPU-marked test)
            await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={"packed": False}))
            return
        from ember.sampling.transport import WeightSender

        if self._sender is not None:
            self._sender.close()
        self._sender = WeightSender(timeout_s=self.timeout_s)
        address = self._sender.open("engine")
        info = dict(host=address.host, port=address.port, timeout_s=self.timeout_s)
        await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))

    async def push(self, llm, tensors: dict[str, torch.Tensor], tag: str) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        if self.device == "cpu" and "engine" not in self._sender.receivers:
            await self.init(llm)  # the last push broke the channel: a new one
        await llm.start_weight_update()
        if self.device == "cpu":
            loop = asyncio.get_running_loop()
            send = loop.run_in_executor(None, self._sender.send, list(tensors.items()), tag)
            try:
                await llm.update_weights(WeightTransferUpdateRequest(update_info={"version": tag}))
            finally:
                report = await send
            if report.dropped:
                raise RuntimeError(f"weight sync into the vLLM engine failed: {report.dropped['engine']}")
        else:  # pragma: no cover - CUDA only (GPU-marked test)
            await llm.update_weights(WeightTransferUpdateRequest(update_info=ipc_update_info(tensors)))
        await llm.finish_weight_update()
        if self.device != "cpu":  # pragma: no cover
            torch.cuda.ipc_collect()

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()


def ipc_update_info(tensors: dict[str, torch.Tensor]) -> dict:
    """vLLM `ipc` engine's update info for CUDA tensors on the engine's own GPU (unpacked:
    one handle per tensor, keyed by the GPU's UUID as vLLM's trainer side does)."""
    from torch.multiprocessing.reductions import reduce_tensor

    handles = []
    for t in tensors.values():
        uuid = str(torch.cuda.get_device_properties(t.device).uuid)
        handles.append({uuid: reduce_tensor(t)[1]})
    return {"names": list(tensors), "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()],
            "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode()}


def register() -> None:
    """Add the engine to vLLM's factory (idempotent)."""
    if ENGINE_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, EmberGlooEngine)


class EmberWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`): importing it registered the engine."""


register()  # in the engine core: the import through `worker_extension_cls` is what registers it
