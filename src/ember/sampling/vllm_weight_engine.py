"""An `ember_gloo` weight-transfer engine for vLLM (CPU): ember's memory sync into vLLM's worker.

vLLM 0.32 builds a `WeightTransferEngine` in each worker when the engine is started with a
`weight_transfer_config` (`WeightTransferEngineFactory.create_engine`, called from
`Worker.load_model`, which vLLM's `CPUWorker` inherits), and drives it through
`AsyncLLM.init_weight_transfer_engine(init_info)` / `start_weight_update` /
`update_weights(update_info)` / `finish_weight_update`. Its own backends are CUDA-only
(`nccl`, `ipc`, ...), and the base class's `update_weights` ends with
`torch.accelerator.synchronize()`, which raises "Cannot access accelerator device when
none is available" on a CPU build. This engine joins an `ember.sampling.weight_sync`
channel (a standalone gloo group) and loads what it receives with the model's own
`load_weights`, without that synchronize.

`register()` adds it to vLLM's factory under `ENGINE_NAME`. It must run in the process
that builds the worker (vLLM's engine core, which vLLM starts with `spawn`, so nothing
registered in the parent is there): the engine is started with
`worker_extension_cls=WORKER_EXTENSION`, vLLM imports this module in the worker before it
loads the model, and the import registers the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        from ember.sampling.weight_sync import ChannelAddress, WeightReceiver

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


def register() -> None:
    """Add the engine to vLLM's factory (idempotent)."""
    if ENGINE_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, EmberGlooEngine)


class EmberWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`): importing it registered the engine."""


register()  # in the engine core: the import through `worker_extension_cls` is what registers it
