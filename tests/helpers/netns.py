"""Two "hosts" on one machine: two network namespaces joined by a veth pair, a Ray head in
one and a Ray worker node in the other (README, "Scaling out").

    with TwoHosts.start() as hosts:            # or the `two_hosts` fixture
        hosts.run(["python", "-m", ...])         # runs in the head's namespace
        hosts.env("head")                        # RAY_ADDRESS, GLOO_SOCKET_IFNAME, ...

Every name carries a random suffix (namespaces `emb-<sfx>-a/b`, links `e<sfx>a/b`, the
Ray temp dir `/tmp/ray-<sfx>`) and the pair gets a random private /30 in 10.x, so tests
running in parallel never collide. The namespaces have no route out: all traffic (Ray,
gloo, HTTP) stays between the two. `stop()` always stops both Ray nodes and deletes both
namespaces — pass, fail, or KeyboardInterrupt (the context manager's `finally`).

What it took (each failed first, see the two-host note in the README's "Scaling out"):
Ray 2.60 turns token authentication on for `ray start --head`, so every participant gets
`RAY_AUTH_MODE=token` (the token file is shared: one filesystem); gloo must be told its
interface (`GLOO_SOCKET_IFNAME`), or its rendezvous hangs resolving the hostname.
"""

from __future__ import annotations

import os
import secrets
import signal
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from helpers.server import wait_until

RAY_BIN = str(Path(sys.executable).with_name("ray"))
HEAD_PORT = 6379  # each namespace has its own port space: a fixed port never collides
# Ray daemons these tests never use, each a Python process importing ray (~1-2 s of CPU on
# the 2-core CI machine, while every other process starts too): the log monitor streams
# workers' prints to drivers (every driver here passes log_to_driver=False); the
# autoscaler's monitor (`--no-monitor`, hidden in `ray start --help`) has nothing to scale
# on a fixed two-node cluster. The dashboard agent, the runtime-env agent and the head's
# API server stay: the raylet needs the agents, and Ray starts the API server regardless.
LEAN_NODE = ("--include-log-monitor=false",)
LEAN_HEAD = ("--no-monitor",)


def unavailable_reason() -> str | None:
    """Why two namespaces cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "two-host tests need root to create network namespaces (ip netns); not root here"
    if shutil.which("ip") is None:
        return "two-host tests need `ip` (iproute2) for network namespaces; not on PATH"
    probe = _probe_network()
    if probe:
        return probe
    if not Path(RAY_BIN).exists():
        return f"the ray CLI is not installed next to {sys.executable}"
    return None


def _probe_network() -> str | None:
    """Make (and remove) a namespace holding a veth pair: a container without the needed
    capabilities answers `ip netns list` but refuses this."""
    sfx = secrets.token_hex(3)
    ns, a, b = f"emb-probe-{sfx}", f"p{sfx}a", f"p{sfx}b"
    try:
        for args in (("netns", "add", ns), ("link", "add", a, "type", "veth", "peer", "name", b),
                     ("link", "set", b, "netns", ns)):
            out = _ip(*args, check=False)
            if out.returncode != 0:
                return f"`ip {' '.join(args)}` is refused here ({out.stderr.strip()}): no network namespaces"
        return None
    finally:
        _ip("link", "del", a, check=False)
        _ip("netns", "del", ns, check=False)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@dataclass
class Host:
    netns: str
    link: str
    address: str


@dataclass
class TwoHosts:
    """Two namespaces (`head`, `worker`) with a Ray node each; see the module docstring."""

    suffix: str
    head: Host
    worker: Host
    temp_dir: str
    num_cpus: int = 1
    _made: list[str] = field(default_factory=list)
    _ray_up: list[str] = field(default_factory=list)

    @classmethod
    def create(cls, num_cpus: int = 1) -> "TwoHosts":
        sfx = secrets.token_hex(3)
        net = f"10.{secrets.randbelow(200) + 20}.{secrets.randbelow(256)}"
        base = 4 * secrets.randbelow(63)  # a random /30: .base+1 and .base+2
        return cls(sfx, Host(f"emb-{sfx}-a", f"e{sfx}a", f"{net}.{base + 1}"),
                   Host(f"emb-{sfx}-b", f"e{sfx}b", f"{net}.{base + 2}"), f"/tmp/ray-{sfx}", num_cpus)

    @classmethod
    def start(cls, num_cpus: int = 1, timeout_s: float = 120.0) -> "TwoHosts":
        """Namespaces, link and both Ray nodes up; on any failure everything made is removed."""
        hosts = cls.create(num_cpus)
        try:
            hosts._make_network()
            hosts._start_ray(timeout_s)
        except BaseException:
            hosts.stop()
            raise
        return hosts

    def __enter__(self) -> "TwoHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def ray_address(self) -> str:
        return f"{self.head.address}:{HEAD_PORT}"

    def env(self, role: str = "head") -> dict[str, str]:
        """The environment of a process on `role`'s host (head | worker)."""
        host = self.head if role == "head" else self.worker
        env = dict(os.environ)
        env.update(RAY_AUTH_MODE="token", GLOO_SOCKET_IFNAME=host.link, RAY_ADDRESS=self.ray_address,
                   RAY_USAGE_STATS_ENABLED="0", EMBER_NODE_IP=host.address)
        env.pop("RAY_TMPDIR", None)
        return env

    def argv(self, cmd: list[str], role: str = "head") -> list[str]:
        host = self.head if role == "head" else self.worker
        return ["ip", "netns", "exec", host.netns, *cmd]

    def run(self, cmd: list[str], role: str = "head", timeout: float = 600, **kw) -> subprocess.CompletedProcess:
        """Run `cmd` on one host and wait; capture its output."""
        return subprocess.run(self.argv(cmd, role), env=self.env(role), capture_output=True, text=True,
                              timeout=timeout, **kw)

    def popen(self, cmd: list[str], role: str = "head", **kw) -> subprocess.Popen:
        return subprocess.Popen(self.argv(cmd, role), env=self.env(role), **kw)

    # ------------------------------------------------------------------ setup
    def _make_network(self) -> None:
        for host in (self.head, self.worker):
            _ip("netns", "add", host.netns)
            self._made.append(host.netns)
        _ip("link", "add", self.head.link, "type", "veth", "peer", "name", self.worker.link)
        for host in (self.head, self.worker):
            _ip("link", "set", host.link, "netns", host.netns)
            _ip("-n", host.netns, "addr", "add", f"{host.address}/30", "dev", host.link)
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", host.netns, "link", "set", host.link, "up")

    def _ray_start(self, role: str, args: list[str]) -> None:
        host = self.head if role == "head" else self.worker
        cmd = [RAY_BIN, "start", f"--node-ip-address={host.address}", f"--num-cpus={self.num_cpus}",
               "--num-gpus=0", "--disable-usage-stats", *LEAN_NODE, *args]
        self._ray_up.append(role)  # before starting: a half-started node is stopped too
        out = self.run(cmd, role, timeout=180)
        if out.returncode != 0:
            raise RuntimeError(f"ray start on {role} ({host.netns}) failed:\n{out.stdout}\n{out.stderr}")

    def _start_ray(self, timeout_s: float) -> None:
        self._ray_start("head", ["--head", f"--port={HEAD_PORT}", "--include-dashboard=false", *LEAN_HEAD,
                                 f"--temp-dir={self.temp_dir}"])
        self._ray_start("worker", [f"--address={self.ray_address}"])
        self.wait_for_nodes(2, timeout_s)

    def alive_nodes(self) -> list[str]:
        """Node IPs of the cluster's live nodes, asked from the head's namespace."""
        code = ("import ray; ray.init(address='auto', log_to_driver=False); "
                "print(' '.join(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])))")
        out = self.run([sys.executable, "-c", code], "head", timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"could not list the cluster's nodes:\n{out.stderr[-2000:]}")
        return out.stdout.strip().splitlines()[-1].split() if out.stdout.strip() else []

    def wait_for_nodes(self, n: int, timeout_s: float) -> None:
        wait_until(lambda: len(self.alive_nodes()) >= n, timeout_s, interval=1,
                   message=f"{n} nodes in the Ray cluster")

    # ------------------------------------------------------------------ teardown
    def stop(self) -> None:
        """Stop both Ray nodes, delete both namespaces (the veth pair goes with them).
        Idempotent; never raises, so it can run from any `finally`.

        Not `ray stop`: it finds Ray processes by name on the whole machine (one PID
        namespace), so it would stop other clusters too. Every process of ours runs inside
        one of our namespaces, so `ip netns pids` names exactly ours: SIGTERM, then SIGKILL."""
        try:
            # A short SIGTERM grace: Ray's gcs_server and raylets take over 10 s to exit on
            # SIGTERM, and nothing they would flush outlives the namespaces and temp dir.
            self._signal_all(signal.SIGTERM, grace_s=2.0)
            self._signal_all(signal.SIGKILL)
        finally:  # even when interrupted while waiting: the namespaces go
            self._ray_up.clear()
            for ns in self._made:
                _ip("netns", "del", ns, check=False)
            self._made.clear()
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _signal_all(self, sig: int, grace_s: float = 10.0) -> None:
        """`sig` (and SIGCONT, so a stopped process acts on it) to every process in our
        namespaces; wait up to `grace_s` for them to go."""
        pids = [p for ns in self._made for p in _netns_pids(ns)]
        for pid in pids:
            for s in (sig, signal.SIGCONT):
                try:
                    os.kill(pid, s)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline and any(_netns_pids(ns) for ns in self._made):
            time.sleep(0.2)


class SharedTwoHosts:
    """One `TwoHosts` for the files of the unit "two hosts" (helpers.scheduling): started by
    the first test that asks, stopped after the last test that takes it (conftest's teardown
    hook) or at the session's end; a test that asks after that gets a new pair. A namespace
    pair with a Ray node in each costs ~20 s of two-host set-up; each file's job still stops
    what it started (its server, its actors) before the next uses the cluster."""

    def __init__(self) -> None:
        self.hosts: TwoHosts | None = None

    def start(self) -> TwoHosts:
        if self.hosts is None:
            self.hosts = TwoHosts.start()
        return self.hosts

    def stop(self) -> None:
        hosts, self.hosts = self.hosts, None
        if hosts is not None:
            hosts.stop()


def _netns_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in out.stdout.split() if p.isdigit()]


def namespaces_with_suffix(suffix: str) -> list[str]:
    """Namespaces still present whose name carries `suffix` (for the cleanup test)."""
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if suffix in line]


def pids_running(ns: str, text: str) -> list[int]:
    """Processes in namespace `ns` whose command line contains `text` (e.g. Ray sets an
    actor's process title to `ray::<Class>...`)."""
    found = []
    for pid in _netns_pids(ns):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(pid)
    return found
