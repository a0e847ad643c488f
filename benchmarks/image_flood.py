"""Image flood: a victim tenant's 4-token text samples while another tenant floods image
requests (issue 43), against a real `ember serve` on a tiny Qwen3-VL under an 8 GB
address-space cap (`prlimit --as`), default limits.

The victim (its own API key, the official SDK) samples 4 tokens of a text prompt, one
request at a time: `--samples` alone, then as many while the attacker (another key) keeps
`--flood` raw `/api/v1/asample` requests in flight, each holding `--images` PNGs of
4096 x 4096 (1-bit, ~2 kB each, 16.7 M pixels decoded) with the last one truncated, so
every image but the last is decoded before the request is refused. With the default 16
images a request is at `max_request_image_pixels` (the issue's 64 are refused from their
headers, which costs nothing to decode). `image_flood_p99_ratio` is the victim's p99
latency under the flood over its p99 alone (target <= 2).

    python benchmarks/image_flood.py [--samples 20] [--flood 16] [--images 16]

Last line: `image_flood_p99_ratio=<r> attack_requests=<n> attack_429=<n> attack_refused=<n>
attack_5xx=<n> victim_failed=<n>`.
"""

from __future__ import annotations

import argparse
import base64
import io
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402,F401 - test helpers on sys.path, offline settings

TESTS = str(Path(__file__).resolve().parents[1] / "tests")
# the server forks from helpers.zygote, a process of its own that imports the helpers too
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)

MODEL = "bench/qwen3-vl-tiny"
VICTIM_KEY, ATTACKER_KEY = "tml-victim", "tml-attacker"
MEMORY_CAP_BYTES = 8 * 1024**3  # the prlimit --as=8589934592


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def flood_body(session: str, images: int) -> bytes:
    import json

    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (4096, 4096)).save(buf, format="PNG")
    big = buf.getvalue()
    chunk = {"type": "image", "format": "png", "expected_tokens": None}
    chunks = [{"type": "encoded_text", "tokens": [1, 2]}]
    chunks += [{**chunk, "data": base64.b64encode(big).decode()}] * (images - 1)
    chunks += [{**chunk, "data": base64.b64encode(big[: len(big) // 2]).decode()}]
    return json.dumps({"sampling_session_id": session, "seq_id": 0, "num_samples": 1,
                       "prompt": {"chunks": chunks}, "sampling_params": {"max_tokens": 4}}).encode()


def sampling_session(base_url: str, key: str) -> str:
    with httpx.Client(base_url=base_url + "/api/v1", headers={"X-API-Key": key}, timeout=120) as http:
        session = http.post("/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "x"})
        session.raise_for_status()
        r = http.post("/create_sampling_session", json={"session_id": session.json()["session_id"],
                                                        "sampling_session_seq_id": 0, "base_model": MODEL})
        r.raise_for_status()
        return r.json()["sampling_session_id"]


def attacker(base_url: str, body: bytes, stop, outcomes: Counter, lock: threading.Lock) -> None:
    """Send the flood request again and again (no back-off: an attacker ignores Retry-After)."""
    headers = {"X-API-Key": ATTACKER_KEY, "Content-Type": "application/json"}
    with httpx.Client(base_url=base_url + "/api/v1", headers=headers, timeout=300) as http:
        while not stop.is_set():
            r = http.post("/asample", content=body)
            kind = "429" if r.status_code == 429 else "5xx" if r.status_code >= 500 else "refused"
            if r.status_code == 200:  # a future: its outcome is the refusal of the truncated image
                rid = r.json()["request_id"]
                while (f := http.post("/retrieve_future", json={"request_id": rid})).json().get("type") == "try_again":
                    pass
                kind = "5xx" if f.status_code >= 500 or f.json().get("category") == "server" else "refused"
            with lock:
                outcomes[kind] += 1


def attack_process(base_url: str, body: bytes, flood: int, stop, results) -> None:
    """The attacker in a process of its own at nice 19 (its threads would otherwise share
    the victim's interpreter lock here, and its client's CPU the victim's cores, slowing
    the victim's client, not the server): `flood` threads until `stop` is set, then its
    outcome counts on `results`."""
    os.nice(19)  # the attacker's own client work is not the server's: on one host, it yields the cores
    lock, outcomes = threading.Lock(), Counter()
    threads = [threading.Thread(target=attacker, args=(base_url, body, stop, outcomes, lock), daemon=True)
               for _ in range(flood)]
    for t in threads:
        t.start()
    stop.wait()
    deadline = time.monotonic() + 60  # in-flight attacks end within the admission wait
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    with lock:
        results.put(dict(outcomes))


def victim(sampler, samples: int, failed: list[str]) -> list[float]:
    from tinker import types

    prompt, params = types.ModelInput.from_ints([1, 2, 3, 4]), types.SamplingParams(max_tokens=4, seed=1)
    latencies = []
    for _ in range(samples):
        t0 = time.perf_counter()
        try:
            sampler.sample(prompt, 1, params).result(timeout=300)
        except Exception as exc:  # noqa: BLE001 - counted and reported
            failed.append(f"{type(exc).__name__}: {exc}"[:200])
            continue
        latencies.append(time.perf_counter() - t0)
    return latencies


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=20, help="victim samples alone, and as many under the flood")
    ap.add_argument("--flood", type=int, default=16, help="attacker requests kept in flight")
    ap.add_argument("--images", type=int, default=16, help="4096x4096 PNGs per attacker request (last truncated)")
    args = ap.parse_args(argv)

    import tinker

    from ember.models.testing import build_tiny_model
    from helpers.server import memory_cap, start_server

    tmp = Path(tempfile.mkdtemp(prefix="ember-image-flood-"))
    model_dir = build_tiny_model(tmp / "model", family="qwen3_vl")
    server = start_server(Path(model_dir), tmp / "serve", model_name=MODEL, keys=(VICTIM_KEY, ATTACKER_KEY),
                          wrap=memory_cap(MEMORY_CAP_BYTES),
                          # the helper logs request bodies for tests to read: not what a server does
                          extra_args=["--request-log-bodies", "off"])
    try:
        sc = tinker.ServiceClient(base_url=server.base_url, api_key=VICTIM_KEY)
        sampler = sc.create_sampling_client(base_model=MODEL).result(timeout=300)
        failed: list[str] = []
        victim(sampler, 3, failed)  # warm-up
        alone = victim(sampler, args.samples, failed)
        body = flood_body(sampling_session(server.base_url, ATTACKER_KEY), args.images)
        ctx = multiprocessing.get_context("spawn")
        stop, results = ctx.Event(), ctx.Queue()
        attack = ctx.Process(target=attack_process, args=(server.base_url, body, args.flood, stop, results))
        attack.start()
        time.sleep(5.0)  # the attacker's process has started and its flood is under way
        flooded = victim(sampler, args.samples, failed)
        stop.set()
        outcomes = Counter(results.get(timeout=120))
        attack.join(30)
        sc.close("success").result(timeout=60)
    finally:
        server.stop()
    stderr = server.stderr_path.read_text()
    ratio = pct(flooded, 99) / pct(alone, 99)
    print(f"victim 4-token samples: p50/p99 alone {pct(alone, 50) * 1e3:.1f}/{pct(alone, 99) * 1e3:.1f} ms, "
          f"under the flood {pct(flooded, 50) * 1e3:.1f}/{pct(flooded, 99) * 1e3:.1f} ms")
    print(f"attacker: {args.flood} requests in flight x {args.images} 4096x4096 PNGs: {dict(outcomes)}; "
          f"MemoryError in the server log: {'MemoryError' in stderr}; victim failures: {failed[:3]}")
    print(f"image_flood_p99_ratio={ratio:.2f} attack_requests={sum(outcomes.values())} "
          f"attack_429={outcomes['429']} attack_refused={outcomes['refused']} attack_5xx={outcomes['5xx']} "
          f"victim_failed={len(failed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
