"""Run `ember serve` as a real subprocess and read its request log (tests, benchmarks).

The server runs with `--request-log-bodies on`: the tests read request bodies back.

    server = start_server(model_dir, workdir)        # random loopback port, temp data dir
    client = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    ...
    server.requests("/api/v1/forward_backward")       # what the server received, in order
    server.stop()
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from helpers.zygote import FORK, Zygote

# `ember serve` (or a script taking its arguments) starts forked from a pre-imported process
# (helpers.zygote) unless EMBER_TEST_FORK=0; one wrapped in a command other than
# `memory_cap`'s `prlimit` (the child sets that limit on itself) execs.

API_KEY = "tml-test"
OTHER_KEY = "tml-other"
MODEL_NAME = "tiny/qwen3"


@dataclass
class ServerProc:
    proc: subprocess.Popen
    base_url: str
    port: int
    data_dir: Path
    log_path: Path
    stderr_path: Path
    stdout_lines: list[str] = field(default_factory=list)  # what it printed (read as it comes)

    def requests(self, path_suffix: str | None = None) -> list[dict]:
        """Entries of the server's request log, in arrival order.

        Each has `n` (arrival order), `t`/`t_end` (arrival/answer time), `method`, `path`,
        `status`, chosen `headers`, `json` (the request body when it was a JSON object,
        else {}), `response` (a JSON answer) and `extra` (what the route decoded, or {}).
        """
        if not self.log_path.exists():
            return []
        # The server may be writing the last line as it is read: only whole lines count.
        lines = self.log_path.read_text().split("\n")[:-1]
        entries = [json.loads(line) for line in lines if line.strip()]
        for e in entries:
            e["json"] = e["json"] if isinstance(e.get("json"), dict) else {}
            e["extra"] = e.get("extra") or {}
        entries.sort(key=lambda e: e["n"])
        if path_suffix is not None:
            entries = [e for e in entries if e["path"].endswith(path_suffix)]
        return entries

    def log_mark(self) -> float:
        """A point in time; `requests_since(mark)` returns what arrived after it."""
        time.sleep(0.01)
        return time.time()

    def requests_since(self, mark: float, path_suffix: str | None = None) -> list[dict]:
        return [e for e in self.requests(path_suffix) if e["t"] >= mark]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def kill9(self) -> None:
        self.proc.kill()  # SIGKILL
        self.proc.wait(10)

    def stderr_tail(self, n: int = 4000) -> str:
        return self.stderr_path.read_text()[-n:] if self.stderr_path.exists() else ""


def memory_cap(max_bytes: int) -> list[str]:
    """A `start_server(wrap=...)` prefix capping the server's address space (util-linux
    prlimit): a request that slips past a limit fails an allocation in the server
    instead of growing it until the kernel's OOM killer picks a victim on a shared machine."""
    return ["prlimit", f"--as={int(max_bytes)}", "--"]


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


def start_server(
    model_dir: Path,
    workdir: Path,
    *,
    port: int = 0,
    extra_args: Sequence[str] = (),
    script: Path | None = None,
    data_dir: Path | None = None,
    timeout: float = 180.0,
    model_name: str = MODEL_NAME,
    wrap: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    keys: Sequence[str] = (API_KEY, OTHER_KEY),
) -> ServerProc:
    """Start `ember serve` (or a wrapper script taking the same arguments) and wait for it.

    `wrap` prefixes the command, e.g. `memory_cap(4 << 30)` to bound a server that tests
    are about to send hostile sizes; `env` adds to the server's environment (e.g.
    `{"EMBER_FAILPOINTS": "checkpoint.after_write=kill"}`); `keys=()` starts it in the
    default loopback mode (any `tml-` key, each its own tenant)."""
    workdir.mkdir(parents=True, exist_ok=True)
    data_dir = data_dir or workdir / "data"
    log_path = workdir / "requests.jsonl"
    stderr_path = workdir / f"stderr-{time.time_ns()}.txt"
    launcher = [str(script)] if script else ["-m", "ember.cli", "serve"]  # the real `ember serve`
    cmd = [
        *wrap, sys.executable, *launcher,
        "--model", f"{model_name}={model_dir}",
        "--data-dir", str(data_dir),
        "--port", str(port),
        *(arg for key in keys for arg in ("--api-key", key)),
        "--request-log", str(log_path), "--request-log-bodies", "on",
        "--log-level", "warning",
        # Modules that talk raw HTTP hold sessions without heartbeats for longer than the
        # default 300 s (a shared server lives all session): tests of that expiry set their own.
        "--sessions.heartbeat_timeout_s", "86400",
        # A stop saves no run (README "Restarts"): a shared server holds many, and its stop must
        # stay quick; the restart tests turn it on.
        "--runs.save_on_shutdown", "false",
        *extra_args,
    ]
    full_env = {**server_env(), **(env or {})}
    cap = _address_space_cap(wrap)
    forkable = FORK and (not wrap or cap is not None)
    argv = cmd[len(wrap) + 1 + len(launcher):]  # after `python SCRIPT` or `python -m ember.cli serve`
    argv = argv if script else ["serve", *argv]
    proc = _forked_serve(argv, workdir, full_env, stderr_path, cap, script) if forkable else None
    if proc is None:
        stderr = open(stderr_path, "w")  # noqa: SIM115 (owned by the child)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=full_env)
    lines: list[str] = []
    url = _wait_for_url(proc, timeout, stderr_path, lines)
    server = ServerProc(proc, url, int(url.rsplit(":", 1)[1]), data_dir, log_path, stderr_path, lines)
    _wait_healthy(server, timeout)
    return server


def _address_space_cap(wrap: Sequence[str]) -> int | None:
    """The byte count of a `memory_cap(...)` wrapper, else None."""
    if len(wrap) == 3 and wrap[0] == "prlimit" and wrap[1].startswith("--as=") and wrap[2] == "--":
        return int(wrap[1].removeprefix("--as="))
    return None


def _forked_serve(argv: Sequence[str], workdir: Path, env: Mapping[str, str], stderr_path: Path,
                  address_space_cap: int | None, script: Path | None):
    """`ember ARGV` (or `python SCRIPT ARGV`) forked from this worker's zygote (helpers.zygote:
    the imports are made once per pytest worker), its stdout a FIFO read like a pipe, under `address_space_cap` bytes
    (RLIMIT_AS, what `prlimit --as` sets) if given; None when no zygote can run."""
    zygote = Zygote.shared(server_env())
    if zygote is None:
        return None
    fifo = workdir / f"stdout-{time.time_ns()}.fifo"
    os.mkfifo(fifo)
    proc = zygote.spawn(argv, cwd=None, env=env, stdout=fifo, stderr=stderr_path,
                        address_space_cap=address_space_cap, script=script)
    proc.stdout = _FifoLines(fifo)
    return proc


class _FifoLines:
    """Lines from a FIFO, opened on first read (the open waits for the writer, like a pipe's
    read end whose child has started)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __iter__(self):
        with open(self.path) as f:
            yield from f


def _wait_for_url(proc: subprocess.Popen, timeout: float, stderr_path: Path, lines: list[str]) -> str:
    found: list[str] = []

    def reader() -> None:
        for line in proc.stdout:  # keep draining so the child never blocks on a full pipe
            if len(lines) < 1000:
                lines.append(line.rstrip("\n"))
            if "listening on" in line and not found:
                found.append(line.strip().rsplit(" ", 1)[1])

    def started() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"ember serve exited with {proc.returncode}:\n{stderr_path.read_text()[-4000:]}")
        return bool(found)

    threading.Thread(target=reader, daemon=True).start()
    try:
        wait_until(started, timeout, interval=0.1, message="ember serve to start")
    except AssertionError:
        proc.kill()
        raise RuntimeError(f"ember serve did not start in {timeout} s:\n{stderr_path.read_text()[-4000:]}") from None
    return found[0]


def _wait_healthy(server: ServerProc, timeout: float) -> None:
    """Any HTTP answer means uvicorn is serving (404 when the API sits under a prefix)."""
    def answers() -> bool:
        try:
            httpx.get(f"{server.base_url}/api/v1/healthz", timeout=5)
            return True
        except httpx.HTTPError:
            if not server.alive():
                raise RuntimeError(f"ember serve died:\n{server.stderr_tail()}") from None
            return False

    try:
        wait_until(answers, timeout, message="ember serve to answer /api/v1/healthz")
    except AssertionError:
        raise RuntimeError("ember serve never answered /api/v1/healthz") from None


def wait_until(predicate, timeout: float, interval: float = 0.2, message: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {message}")


def future_outcome(http: httpx.Client, request_id: str, timeout: float = 120, path: str = "/retrieve_future",
                   statuses: Sequence[int] = (200,)) -> dict:
    """The JSON answer of `retrieve_future` once it is not `try_again` (the server long-polls,
    so no pause between asks); `http` carries the base URL and key, `path` is relative to it.
    An answer with a status outside `statuses` fails the test, naming it."""
    def answer() -> dict | None:
        r = http.post(path, json={"request_id": request_id}, headers={"Accept": "application/json"})
        assert r.status_code in statuses, r.text[:500]
        return None if r.json().get("type") == "try_again" else r.json()

    return wait_until(answer, timeout, interval=0, message=f"future {request_id} to finish")


def sft_datum(tokens: Sequence[int], weights: Sequence[float] | None = None):
    """A next-token cross-entropy datum: input tokens[:-1], targets tokens[1:]."""
    from tinker import types

    inputs, targets = list(tokens[:-1]), list(tokens[1:])
    w = list(weights) if weights is not None else [1.0] * len(targets)
    return types.Datum(model_input=types.ModelInput.from_ints(inputs),
                       loss_fn_inputs={"target_tokens": targets, "weights": w})


def stable_datum(prompt: Sequence[int], sequence, advantage: float = 1.0):
    """A `stable_reinforce` datum for one sampled sequence, as an RL loop builds it: input
    prompt + sampled[:-1], targets prompt[1:] + sampled, advantage 0 on the prompt rows,
    with provenance naming the sequence (prompt run, then sampled run)."""
    from tinker import types

    sid, sampled = sequence.sequence_id, list(sequence.tokens)
    full = list(prompt) + sampled
    adv = [0.0] * (len(prompt) - 1) + [float(advantage)] * len(sampled)
    datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": full[1:], "advantages": adv})
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
                     types.SampledProvenanceSpan(sequence_id=sid, length=len(sampled) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(prompt) - 1),
                        types.SampledProvenanceSpan(sequence_id=sid, length=len(sampled))],
    )


def stable_reinforce_loss(prompt_len: int, sequences, outputs, advantages, low: float = 0.5,
                          high: float = 2.0) -> float:
    """`stable_reinforce`'s documented formula recomputed from returned values: trainer
    logprobs (`loss_fn_outputs`) and the sampler's `SampledSequence.logprobs`."""
    import numpy as np

    total = 0.0
    for seq, out, adv in zip(sequences, outputs, advantages, strict=True):
        logp = np.asarray(out["logprobs"].to_numpy(), dtype=np.float64)[prompt_len - 1:]
        ratio = np.exp(logp - np.asarray(seq.logprobs, dtype=np.float64))
        keep = (ratio >= low) & (ratio <= high)
        total += float(-(keep * ratio * adv).sum())
    return total


def paths(entries: Sequence[dict], skip_background: bool = True) -> list[str]:
    """`/api/v1/...` paths of log entries; heartbeats and telemetry left out by default."""
    background = ("/session_heartbeat", "/telemetry")
    out = [e["path"].split("/api/v1", 1)[-1] for e in entries]
    return [p for p in out if not (skip_background and p.endswith(background))]
