"""`inline` runtime: one rank in the calling process (the default; zero overhead).

Requests are executed directly on a `RankWorker` in this process: no pickling, no process
group (`RankContext.backend is None`), so a world-1 engine runs exactly as a bare
TorchEngine does. Timeouts cannot interrupt inline calls; nothing can die separately.
"""

from __future__ import annotations

from ember.workers.runtime import RankContext, Reply, Request, Runtime
from ember.workers.worker import RankWorker


class InlineRuntime(Runtime):
    name = "inline"

    def __init__(self, world_size: int = 1, device: str = "cpu") -> None:
        if world_size != 1:
            raise ValueError(f"the inline runtime has exactly one rank; got world_size={world_size} (use 'process' or 'ray')")
        super().__init__(1, device)
        self._worker: RankWorker | None = None

    def start(self) -> None:
        ctx = RankContext(rank=0, world_size=1, local_rank=0, device_type=self.device_type, backend=None)
        self._worker = RankWorker(ctx)

    def execute(self, requests: list[Request], timeout_s: float) -> list[Reply]:
        if self._worker is None:
            raise RuntimeError("inline runtime is not started (or was shut down)")
        return [self._worker.handle(requests[0])]

    def shutdown(self) -> None:
        self._worker = None

    def alive(self) -> list[bool]:
        return [self._worker is not None]
