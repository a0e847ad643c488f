"""`EngineConfig.compile`: regional `torch.compile` of a TorchEngine (docs/architecture.md#compile).
`CompileStats` and `use_cache_dir` are also what TorchSampler's `[sampler.torch] compile`
counts and caches with (`ember.sampling.decoder.compiled_kernels`).

What is compiled, as torchtitan does it:

* each decoder layer, once, in place (`nn.Module.compile`: the module keeps its class, its
  parameter names and its hooks, so state dicts, checkpoints, peft and FSDP2 see the same
  model). Layers are compiled after the layout is applied (TP's `parallelize_module`, CP's
  attention, `fully_shard`: torchtitan's order), so FSDP2's per-layer hooks run around the
  compiled forward, and TP's DTensor projections and CP's all-to-alls are traced inside it
  (TP's Linears multiply 2-D inputs: `ember.engine.parallel._flat_styles` says why);
* the policy head's chunk function (LM head, fp32 log-softmax, target gather:
  `ember.engine.heads.PolicyHead.use_chunk_fn`) and each loss function the engine runs.

Everything is compiled with `dynamic=True`: sequence lengths (and chunk sizes) are symbolic,
so a new length does not compile again (0 and 1 are specialised by torch, so a batch of one
row and one of several compile separately). The backend is inductor, wrapped by
`CompileStats.backend` to count the graphs it compiles: the count tests and `EngineInfo`
report. The first call pays the compilation: the engine runs a warm-up forward and backward
at start and reports its seconds; inductor's caches (FX graph and AOTAutograd) live under
`EngineConfig.compile_cache_dir`, so a restarted server reads them instead of compiling again.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


@dataclass
class CompileStats:
    """What compilation cost one engine: graphs compiled so far (forward graphs handed to
    inductor by dynamo; a recompilation adds one) and the warm-up's seconds at start."""

    graphs: int = 0
    warmup_seconds: float = 0.0
    compile_seconds: float = 0.0  # inside inductor (the backend), every graph so far
    cache_dir: str = ""
    compiled_layers: int = 0
    _compiled: dict = field(default_factory=dict, repr=False)

    def backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        """A `torch.compile` backend: inductor, counting each graph it is handed."""
        import torch._inductor

        self.graphs += 1
        start = time.perf_counter()
        try:
            return torch._inductor.compile(gm, example_inputs)
        finally:
            self.compile_seconds += time.perf_counter() - start

    def compiled(self, fn: Callable) -> Callable:
        """`fn` compiled (dynamic shapes, this backend), once per function."""
        if fn not in self._compiled:
            self._compiled[fn] = torch.compile(fn, dynamic=True, backend=self.backend)
        return self._compiled[fn]

    def as_dict(self) -> dict:
        return {"graphs": self.graphs, "warmup_seconds": round(self.warmup_seconds, 3),
                "compile_seconds": round(self.compile_seconds, 3),
                "cache_dir": self.cache_dir, "compiled_layers": self.compiled_layers}


def use_cache_dir(path: str | os.PathLike | None) -> str:
    """Point inductor's on-disk caches at `path` (created); "" or None keeps torch's choice
    (`$TORCHINDUCTOR_CACHE_DIR`, else its default under the temp dir). Inductor reads the
    variable when it compiles, process-wide: an explicit directory wins over the variable."""
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        os.environ[CACHE_ENV] = str(Path(path).resolve())
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def compile_layers(layers: nn.ModuleList, stats: CompileStats) -> None:
    """Compile every decoder layer in place (`nn.Module.compile`, dynamic shapes)."""
    for layer in layers:
        if getattr(layer, "_compiled_call_impl", None) is not None:
            continue  # a base model shared by LoRA engines: compiled by the first one
        layer.compile(dynamic=True, backend=stats.backend)
    stats.compiled_layers = len(layers)


def on_a_copy(chunk_fn: Callable) -> Callable:
    """`chunk_fn(unembed, hidden, targets, vocab)` called on a copy of `hidden`. The policy
    head's chunks are views of the (T, H) hidden states, and dynamo guards a view input on its
    base's sizes: one chunk covering all T rows and a strict slice of them would compile
    separately. The copy is (chunk, H), beside the chunk's (chunk, V) logits."""

    def call(unembed, hidden, targets, vocab):
        return chunk_fn(unembed, hidden.clone(), targets, vocab)

    return call


def check_compile_layout(ep: int) -> None:
    """Refuse the layouts compile has not been verified with: expert parallelism (ValueError
    naming it). Single device, FSDP2, TP and CP are verified (tests/engine/test_engine_compile.py)."""
    if ep > 1:
        raise ValueError(f"EngineConfig.compile is verified on one device and under FSDP2, TP and CP; expert "
                         f"parallelism (ep={ep}) is not: use compile=false")


def timed(stats: CompileStats, warmup: Callable[[], None]) -> None:
    """Run `warmup` (the first compiled forward and backward) and record and log its time."""
    start = time.perf_counter()
    warmup()
    stats.warmup_seconds = time.perf_counter() - start
    log.info("compiled %d decoder layers in %.1f s (%d graphs; inductor cache %s)",
             stats.compiled_layers, stats.warmup_seconds, stats.graphs, stats.cache_dir)
