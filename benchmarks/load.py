"""Load: N concurrent official-SDK clients against a real `ember serve`, on SQLite and PostgreSQL.

Each client (a thread with its own `tinker.ServiceClient`) trains its own LoRA run on one
shared base model: S steps of `forward_backward` + `optim_step`, and every 5th step a
`save_weights_and_get_sampling_client` + `sample`. Reported per database: completed
SDK calls/s, HTTP requests/s (from the server's own `/metrics`), p50/p99 latency per call
type, failed calls (the future resolved to an error) and lost ones (submitted, never
resolved within the timeout; cross-checked with the server's pending-futures gauge), and
the server's RSS (psutil) before the clients start and after they finish.

PostgreSQL: a throwaway server (`initdb` + `pg_ctl`, Unix socket only, in a temp dir, run
as `nobody` when we are root since initdb refuses root). Without the binaries the
PostgreSQL half is skipped and reported as nan.

Two-tenant fairness (SQLite, its own server): a light tenant's 4-token samples, one at a
time, first alone, then while a heavy tenant keeps `--heavy-requests` requests of
(n=`--heavy-n`, max_tokens=300) queued; the ratio of the light tenant's p99 latency with
the heavy neighbour to its p99 alone is `fair_p99_ratio` (target <= 2: the sampler serves
owners round robin, docs/architecture.md).

    python benchmarks/load.py [--clients 16] [--steps 50] [--quick]

Last line: `clients=<n> lost=<n> failed=<n> rps_sqlite=<x> rps_postgres=<y> rss_growth_mb=<z>
fair_p99_ratio=<r>` (lost/failed summed over both databases; rss growth = the larger of the two).
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # helpers.server (test-only, not shipped)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODEL = "bench/qwen3-tiny"
SAMPLE_EVERY = 5
CALL_TIMEOUT_S = 600.0


@dataclass
class Tally:
    """What every client thread reports, under one lock."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    failed: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def call(self, kind: str, client: int, fn) -> object | None:
        """Time `fn()` (submit + wait); count an error as failed, a timeout as lost."""
        t0 = time.perf_counter()
        try:
            out = fn()
        except TimeoutError as exc:
            with self.lock:
                self.lost.append(f"client {client} {kind}: {exc}")
            return None
        except Exception as exc:  # noqa: BLE001 - counted and reported
            with self.lock:
                self.failed.append(f"client {client} {kind}: {type(exc).__name__}: {exc}"[:300])
            return None
        with self.lock:
            self.latencies[kind].append(time.perf_counter() - t0)
        return out

    @property
    def completed(self) -> int:
        return sum(len(v) for v in self.latencies.values())


def batch(client: int, step: int, n_datums: int = 2, seq_len: int = 32):
    from tinker import types

    data = []
    for i in range(n_datums):
        toks = [(7 * (i + client) + 3 * t + step) % 80 + 2 for t in range(seq_len + 1)]
        data.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                                loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * seq_len}))
    return data


def client_loop(base_url: str, api_key: str, client: int, steps: int, tally: Tally) -> None:
    """One SDK client: its own LoRA run, `steps` fb+optim steps, a sample every 5th step."""
    import tinker
    from tinker import types

    adam = types.AdamParams(learning_rate=1e-3)
    params = types.SamplingParams(max_tokens=16, seed=client, temperature=1.0)
    prompt = types.ModelInput.from_ints([5, 17, 30, 42, 8])
    sc = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    try:
        tc = tally.call("create_model", client, lambda: sc.create_lora_training_client(
            base_model=MODEL, rank=8, seed=client).result(timeout=CALL_TIMEOUT_S))
        if tc is None:
            return
        for step in range(1, steps + 1):
            data = batch(client, step)
            tally.call("forward_backward", client,
                       lambda: tc.forward_backward(data, "cross_entropy").result(timeout=CALL_TIMEOUT_S))
            tally.call("optim_step", client, lambda: tc.optim_step(adam).result(timeout=CALL_TIMEOUT_S))
            if step % SAMPLE_EVERY == 0:
                sampler = tally.call("save_for_sampler", client,
                                     lambda: tc.save_weights_and_get_sampling_client().result(timeout=CALL_TIMEOUT_S))
                if sampler is not None:
                    tally.call("sample", client, lambda: sampler.sample(
                        prompt, num_samples=1, sampling_params=params).result(timeout=CALL_TIMEOUT_S))
    finally:
        try:
            sc.close("success").result(timeout=60)
        except Exception:  # noqa: BLE001 - closing is not what we measure
            pass


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def scrape(base_url: str, api_key: str) -> dict[str, float]:
    """Server-side totals from `/metrics`: HTTP requests and pending futures."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", headers={"X-API-Key": api_key}, timeout=30).text
    out = {"http_requests": 0.0, "pending": 0.0, "failed_futures": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "ember_http_requests_total":
                out["http_requests"] += s.value
            elif s.name == "ember_futures" and s.labels.get("state") == "pending":
                out["pending"] = s.value
            elif s.name == "ember_futures" and s.labels.get("state") == "failed":
                out["failed_futures"] = s.value
    return out


def rss_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def run_load(label: str, model_dir: Path, workdir: Path, clients: int, steps: int,
             extra_args: list[str]) -> dict:
    """Start `ember serve`, run the clients, stop it; the figures of one database."""
    from helpers.server import API_KEY, start_server

    server = start_server(model_dir, workdir, model_name=MODEL, extra_args=extra_args)
    try:
        rss_start = rss_mb(server.proc.pid)
        before = scrape(server.base_url, API_KEY)
        tally = Tally()
        threads = [threading.Thread(target=client_loop, args=(server.base_url, API_KEY, i, steps, tally))
                   for i in range(clients)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        after = scrape(server.base_url, API_KEY)
        rss_end = rss_mb(server.proc.pid)
    finally:
        server.stop()
    return {"label": label, "tally": tally, "wall": wall, "rss_start": rss_start, "rss_end": rss_end,
            "http_rps": (after["http_requests"] - before["http_requests"]) / wall,
            "server_pending": after["pending"], "server_failed": after["failed_futures"] - before["failed_futures"]}


def report(res: dict, clients: int, steps: int) -> None:
    t: Tally = res["tally"]
    samples = steps // SAMPLE_EVERY
    expected = clients * (1 + 2 * steps + 2 * samples)
    print(f"[{res['label']}] {clients} clients x {steps} steps: {t.completed}/{expected} calls in "
          f"{res['wall']:.1f} s = {t.completed / res['wall']:.2f} calls/s ({res['http_rps']:.1f} HTTP req/s "
          f"incl. polls); failed {len(t.failed)} lost {len(t.lost)}; server: pending futures {res['server_pending']:.0f}, "
          f"failed futures {res['server_failed']:.0f}")
    for kind, lat in sorted(t.latencies.items()):
        print(f"[{res['label']}]   {kind:<17} n={len(lat):5d}  p50 {pct(lat, 50) * 1e3:8.1f} ms  "
              f"p99 {pct(lat, 99) * 1e3:8.1f} ms")
    print(f"[{res['label']}] server RSS {res['rss_start']:.0f} MB at start, {res['rss_end']:.0f} MB at end "
          f"(+{res['rss_end'] - res['rss_start']:.0f} MB)")
    for line in (t.failed + t.lost)[:5]:
        print(f"[{res['label']}]   problem: {line}")


# ---------------------------------------------------------------------- two tenants
def light_latencies(sampler, count: int) -> list[float]:
    """`count` 4-token samples, one after another: their latencies (s)."""
    from tinker import types

    prompt = types.ModelInput.from_ints([5, 17, 30, 42, 8])
    params = types.SamplingParams(max_tokens=4, temperature=1.0, stop=[])
    out = []
    for _ in range(count):
        t0 = time.perf_counter()
        sampler.sample(prompt, num_samples=1, sampling_params=params).result(timeout=CALL_TIMEOUT_S)
        out.append(time.perf_counter() - t0)
    return out


def heavy_backlog(sampler, requests: int, n: int, stop: threading.Event) -> None:
    """Keep `requests` requests of n samples x 300 tokens queued until `stop` is set."""
    from tinker import types

    prompt = types.ModelInput.from_ints([9, 8, 7, 6, 5, 4, 3, 2])
    params = types.SamplingParams(max_tokens=300, temperature=1.0, stop=[])
    pending = []
    while not stop.is_set():
        pending = [f for f in pending if not f.done()]
        while len(pending) < requests:
            pending.append(sampler.sample(prompt, num_samples=n, sampling_params=params))
        stop.wait(0.05)


def run_fairness(model_dir: Path, workdir: Path, server_args: list[str], samples: int, heavy_requests: int,
                 heavy_n: int) -> float:
    """p99 of the light tenant's samples with the heavy neighbour / alone."""
    import tinker

    from helpers.server import API_KEY, OTHER_KEY, start_server

    server = start_server(model_dir, workdir, model_name=MODEL, extra_args=server_args)
    try:
        light = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
        heavy = tinker.ServiceClient(base_url=server.base_url, api_key=OTHER_KEY)
        light_sampler = light.create_sampling_client(base_model=MODEL).result(timeout=CALL_TIMEOUT_S)
        heavy_sampler = heavy.create_sampling_client(base_model=MODEL).result(timeout=CALL_TIMEOUT_S)
        light_latencies(light_sampler, 3)  # warm
        alone = light_latencies(light_sampler, samples)
        stop = threading.Event()
        neighbour = threading.Thread(target=heavy_backlog, args=(heavy_sampler, heavy_requests, heavy_n, stop))
        neighbour.start()
        time.sleep(2.0)  # the backlog is queued
        try:
            shared = light_latencies(light_sampler, samples)
        finally:
            stop.set()
            neighbour.join()
    finally:
        server.stop()
    ratio = pct(shared, 99) / pct(alone, 99)
    print(f"[fairness] light tenant, {samples} x 4-token samples: p50/p99 alone {pct(alone, 50) * 1e3:.1f}/"
          f"{pct(alone, 99) * 1e3:.1f} ms; with {heavy_requests} x (n={heavy_n}, max_tokens=300) of a heavy "
          f"tenant queued {pct(shared, 50) * 1e3:.1f}/{pct(shared, 99) * 1e3:.1f} ms; p99 ratio {ratio:.2f}")
    return ratio


# ---------------------------------------------------------------------- PostgreSQL
def postgres_bin() -> Path | None:
    found = shutil.which("initdb")
    if found:  # often a symlink (/usr/local/bin/initdb): createdb sits beside the real one
        return Path(found).resolve().parent
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    return Path(dirs[0]) if dirs and (Path(dirs[0]) / "initdb").exists() else None


def _as_postgres_user(cmd: list[str]) -> list[str]:
    """initdb and postgres refuse to run as root: drop to `nobody` when we are root."""
    return ["runuser", "-u", "nobody", "--", *cmd] if os.geteuid() == 0 else cmd


@contextmanager
def throwaway_postgres(bindir: Path):
    """A PostgreSQL server on a Unix socket in a temp dir; yields its SQLAlchemy URL."""
    root = Path(tempfile.mkdtemp(prefix="ember-load-pg-"))
    data, sock, logfile = root / "data", root / "sock", root / "pg.log"
    sock.mkdir()
    if os.geteuid() == 0:
        shutil.chown(root, "nobody")
        shutil.chown(sock, "nobody")
    run = lambda *cmd: subprocess.run(_as_postgres_user([str(bindir / cmd[0]), *cmd[1:]]),  # noqa: E731
                                      check=True, capture_output=True, text=True)
    try:
        run("initdb", "-D", str(data), "-U", "ember", "--auth=trust", "-E", "UTF8", "--no-sync")
        # fsync off: a throwaway benchmark database; connections: 16 clients + the server's pool
        run("pg_ctl", "-D", str(data), "-l", str(logfile), "-w", "-o",
            f"-k {sock} -c listen_addresses='' -c fsync=off -c max_connections=200", "start")
        run("createdb", "-h", str(sock), "-U", "ember", "ember")
        yield f"postgresql+psycopg://ember@/ember?host={sock}"
    finally:
        subprocess.run(_as_postgres_user([str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "stop"]),
                       capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def run_postgres(model_dir: Path, tmp: Path, clients: int, steps: int, server_args: list[str]) -> dict | None:
    bindir = postgres_bin()
    if bindir is None:
        print("[postgres] PostgreSQL binaries not found (initdb): skipped, rps_postgres=nan")
        return None
    try:
        with throwaway_postgres(bindir) as url:
            return run_load("postgres", model_dir, tmp / "pg", clients, steps,
                            [*server_args, "--database-url", url])
    except subprocess.CalledProcessError as exc:
        print(f"[postgres] could not start a throwaway server: {exc.cmd}: {exc.stderr.strip()[-500:]}")
    except RuntimeError as exc:  # ember serve did not start on PostgreSQL
        print(f"[postgres] ember serve failed on PostgreSQL: {str(exc)[-1500:]}")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="5 steps per client (a smoke test)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the server")
    parser.add_argument("--fair-samples", type=int, default=30, help="light tenant's samples per phase")
    parser.add_argument("--heavy-requests", type=int, default=20, help="heavy tenant's requests kept queued")
    parser.add_argument("--heavy-n", type=int, default=256, help="samples per heavy request")
    parser.add_argument("--fair-only", action="store_true", help="only the two-tenant fairness run")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = min(args.steps, 5)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the server inherits it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still stop the servers in `finally`

    from ember.models.testing import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="ember-load-"))
    results: list[dict] = []
    try:
        model_dir = build_tiny_model(tmp / "model", family="qwen3", seed=0)
        server_args = ["--engine.device", "cpu"]
        print(f"model: tiny qwen3 (hidden 64, 2 layers); {args.clients} clients x {args.steps} steps, "
              f"LoRA rank 8 each on one base model, sample every {SAMPLE_EVERY} steps")
        if not args.fair_only:
            sqlite = run_load("sqlite", Path(model_dir), tmp / "sqlite", args.clients, args.steps, server_args)
            report(sqlite, args.clients, args.steps)
            results.append(sqlite)
            pg = run_postgres(Path(model_dir), tmp, args.clients, args.steps, server_args)
            if pg is not None:
                report(pg, args.clients, args.steps)
                results.append(pg)
        fair = run_fairness(Path(model_dir), tmp / "fair", server_args, args.fair_samples, args.heavy_requests,
                            args.heavy_n)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    # lost: unresolved on the client, or still pending on the server after every client finished
    lost = sum(max(len(r["tally"].lost), int(r["server_pending"])) for r in results)
    failed = sum(len(r["tally"].failed) for r in results)
    rps = {r["label"]: r["tally"].completed / r["wall"] for r in results}
    growth = max((r["rss_end"] - r["rss_start"] for r in results), default=math.nan)
    print(f"clients={args.clients} lost={lost} failed={failed} rps_sqlite={rps.get('sqlite', math.nan):.2f} "
          f"rps_postgres={rps.get('postgres', math.nan):.2f} rss_growth_mb={growth:.1f} fair_p99_ratio={fair:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
