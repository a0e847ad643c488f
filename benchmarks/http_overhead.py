"""HTTP overhead of `ember serve`: the official tinker SDK over HTTP vs `ember.ServiceClient`.

1. forward_backward + optim_step round trips on a ~10M-parameter model (LoRA), the same
   loop in process and over HTTP (server = a real `ember serve` subprocess on loopback):
   per-call p50 of each and the throughput ratio (http_ratio = in-process steps/s divided
   by HTTP steps/s; 1.0 means no overhead).
2. N concurrent SDK clients (default 8), each with its own LoRA run on one base model,
   S steps each (default 50): requests/s, p50/p99 latency, lost or failed futures.

    python benchmarks/http_overhead.py [--steps 30] [--clients 8] [--client-steps 50] [--quick]

3. The metric history's cost to a training step (`ember.service.metric_history`): the
   median time of one history row write (an INSERT into the same kind of SQLite database
   the server uses), times the two rows a fb+step round trip writes, over the in-process
   round trip's median (`metrics_history_overhead`; 0.01 = 1%).

Last line: `http_ratio=<x> lost=<n> metrics_history_overhead=<x>`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # helpers.server (test-only, not shipped)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODEL = "bench/qwen3-10m"


def build_model(out: Path, hidden: int, layers: int) -> tuple[Path, int]:
    import torch

    from ember.models import load_model
    from ember.models.testing import build_tiny_model

    d = build_tiny_model(out, family="qwen3", seed=0, hidden_size=hidden, num_layers=layers,
                         num_heads=hidden // 32, num_kv_heads=hidden // 64, head_dim=32)
    n = sum(p.numel() for p in load_model(d, dtype=torch.float32, device="cpu").parameters())
    return d, n


def batch(n_datums: int, seq_len: int, offset: int = 0):
    from tinker import types

    data = []
    for i in range(n_datums):
        toks = [(7 * (i + offset) + 3 * t) % 80 + 2 for t in range(seq_len + 1)]
        data.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                                loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * seq_len}))
    return data


def one_step(tc, data) -> tuple[float, float]:
    """(forward_backward latency, optim_step latency) of one round trip."""
    from tinker import types

    t0 = time.perf_counter()
    tc.forward_backward(data, "cross_entropy").result()
    t1 = time.perf_counter()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    return t1 - t0, time.perf_counter() - t1


def interleaved_round_trips(local_tc, http_tc, steps: int, data, warmup: int = 2) -> dict[str, list]:
    """Alternate one in-process and one HTTP step so both see the same machine load."""
    for _ in range(warmup):
        one_step(local_tc, data), one_step(http_tc, data)
    out: dict[str, list] = {"local": [], "http": []}
    for _ in range(steps):
        out["local"].append(one_step(local_tc, data))
        out["http"].append(one_step(http_tc, data))
    return out


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def concurrent_clients(base_url: str, api_key: str, clients: int, steps: int, data) -> dict:
    import tinker
    from tinker import types

    latencies: list[float] = []
    failures: list[str] = []
    done = [0] * clients
    lock = threading.Lock()
    adam = types.AdamParams(learning_rate=1e-3)

    def worker(i: int) -> None:
        sc = tinker.ServiceClient(base_url=base_url, api_key=api_key)
        try:
            tc = sc.create_lora_training_client(base_model=MODEL, rank=8, seed=i).result()
            for _ in range(steps):
                for submit in (lambda: tc.forward_backward(data, "cross_entropy"), lambda: tc.optim_step(adam)):
                    t0 = time.perf_counter()
                    try:
                        submit().result(timeout=300)
                        with lock:
                            latencies.append(time.perf_counter() - t0)
                            done[i] += 1
                    except Exception as exc:  # noqa: BLE001 - counted and reported
                        with lock:
                            failures.append(f"client {i}: {type(exc).__name__}: {exc}")
        finally:
            sc.close("success").result(timeout=60)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    expected = clients * steps * 2
    return {"requests": len(latencies), "expected": expected, "failed": len(failures),
            "lost": expected - len(latencies) - len(failures), "wall": wall, "latencies": latencies,
            "failures": failures[:5]}


def history_row_seconds(tmp: Path, rows: int = 400) -> float:
    """Median seconds of one `MetricHistory.record` (one INSERT; the training path's only cost)."""
    from ember.service.metric_history import MetricHistory
    from ember.service.store import Store, default_database_url

    store = Store(default_database_url(tmp))
    history = MetricHistory(store, max_rows=1 << 20)  # no thinning inside the measurement
    times = []
    try:
        for i in range(rows):
            t0 = time.perf_counter()
            history.record("bench-run", i, "forward_backward", {"loss:sum": 1.0 + i, "tokens:sum": 256.0})
            times.append(time.perf_counter() - t0)
    finally:
        history.close()
        store.close()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed fb+step round trips per side")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--client-steps", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--datums", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--device", default="cpu", help="EngineConfig.device for both sides")
    parser.add_argument("--threads", type=int, default=max(1, min(4, (os.cpu_count() or 2) // 2)),
                        help="torch threads in this process and in the server (same on both sides)")
    parser.add_argument("--quick", action="store_true", help="tiny run for a smoke test")
    args = parser.parse_args(argv)
    # Same intra-op threads on both sides; the server inherits OMP_NUM_THREADS. A SIGTERM
    # still runs the `finally` that stops the server subprocess.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.steps, args.client_steps, args.clients, args.hidden, args.layers = 3, 3, 2, 64, 2

    import tinker
    import torch

    import ember
    from ember.engine.config import EngineConfig
    from helpers.server import API_KEY, start_server
    from ember.service import ServiceConfig

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="ember-http-bench-"))
    model_dir, n_params = build_model(tmp / "model", args.hidden, args.layers)
    print(f"model: qwen3 hidden={args.hidden} layers={args.layers} params={n_params / 1e6:.1f}M; "
          f"batch {args.datums}x{args.seq_len} tokens; LoRA rank 8; device {args.device}; threads {args.threads}")
    data = batch(args.datums, args.seq_len)

    local = ember.ServiceClient(config=ServiceConfig(data_dir=tmp / "local", models={MODEL: str(model_dir)},
                                                     engine=EngineConfig(device=args.device)))
    server = start_server(model_dir, tmp / "serve", model_name=MODEL, extra_args=["--engine.device", args.device])
    try:
        sc = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
        local_tc, http_tc = (c.create_lora_training_client(base_model=MODEL, rank=8, seed=0).result()
                             for c in (local, sc))
        rounds = interleaved_round_trips(local_tc, http_tc, args.steps, data)
        sc.close("success").result(timeout=60)
        local.close("success")
        conc = concurrent_clients(server.base_url, API_KEY, args.clients, args.client_steps,
                                  batch(max(1, args.datums // 2), args.seq_len // 2))
        (tmp / "history").mkdir()
        row_s = history_row_seconds(tmp / "history")
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    wall = {k: sum(fb + opt for fb, opt in v) for k, v in rounds.items()}
    ratio = wall["http"] / wall["local"]  # = (in-process steps/s) / (HTTP steps/s)
    for name, label in (("local", "in-process"), ("http", "HTTP (SDK)")):
        fb = statistics.median(r[0] for r in rounds[name]) * 1e3
        opt = statistics.median(r[1] for r in rounds[name]) * 1e3
        print(f"{label:<11}: forward_backward p50 {fb:7.1f} ms  optim_step p50 {opt:6.1f} ms  "
              f"{args.steps / wall[name]:6.2f} steps/s")
    print(f"throughput ratio in-process/HTTP = {ratio:.3f} (HTTP adds "
          f"{(wall['http'] - wall['local']) / args.steps * 1e3:.1f} ms per fb+step round trip)")
    lat = conc["latencies"] or [float("nan")]
    print(f"{args.clients} concurrent SDK clients x {args.client_steps} steps (own LoRA each, one base): "
          f"{conc['requests']}/{conc['expected']} requests in {conc['wall']:.1f} s = "
          f"{conc['requests'] / conc['wall']:.2f} req/s; latency p50 {pct(lat, 50) * 1e3:.1f} ms "
          f"p99 {pct(lat, 99) * 1e3:.1f} ms; failed {conc['failed']} lost {conc['lost']}")
    for line in conc["failures"]:
        print("  failure:", line)
    step_s = statistics.median(fb + opt for fb, opt in rounds["local"])
    history = 2 * row_s / step_s  # a fb + optim_step round trip writes two rows
    print(f"metric history: one row write p50 {row_s * 1e3:.2f} ms; 2 per fb+step round trip of "
          f"{step_s * 1e3:.1f} ms (in-process p50) = {history * 100:.2f}% of the step")
    print(f"http_ratio={ratio:.3f} lost={conc['lost'] + conc['failed']} metrics_history_overhead={history:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
