"""`ServeConfig`: every setting of `ember serve`, one dataclass per component.

    ember serve --config serve.toml --port 9000 --engine.micro_batch_tokens 4096

The components are the ones the code already takes: `ServerConfig` (HTTP), `ServiceConfig`
(data directory, models, and its sections `[engine]`, `[sampler]`, `[limits]`,
`[durability]`, `[stability]`, `[checkpoints]`, `[sessions]`, `[runs]`), `WorkersConfig` (`[workers]`,
`[parallel]`) and `LogConfig` (`[log]`). `ember.config` generates every flag, TOML key and `--help` line from their
fields and docstrings, and checks every value on the way in (a bad key, type or value is
one ConfigError naming it); a flag given on the command line wins over the file, a
repeated one (`--api-key`, `--model NAME=DIR`) adds to the file's list or table.
Adding a field (with a default and a `name: text` docstring entry) to one of these
dataclasses is all it takes to get a setting. `examples/serve.toml` lists every key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ember.config import meta
from ember.server.config import ServerConfig
from ember.server.status import LogConfig
from ember.service.config import ServiceConfig, WorkersConfig

# `--help` group titles per section ("" = the top level)
TITLES = {
    "": "server and service",
    "engine": "[engine] training engine",
    "sampler": "[sampler] sampling (unset device, dtype and max_len follow the engine and the model)",
    "sampler.torch": "[sampler.torch] the torch backend's own settings (older flags: --sampler.KEY)",
    "sampler.vllm": "[sampler.vllm] the vLLM backend's own settings (older flags: --sampler.KEY)",
    "sampler.pool": "[sampler.pool] replicas of the backend behind one router (older flags: --sampler.KEY)",
    "limits": "[limits] per-request limits (each refused as a user error naming the field)",
    "durability": "[durability] futures under database and disk faults",
    "stability": "[stability] records of record_stability_info=True samples, for stable_reinforce",
    "checkpoints": "[checkpoints] checkpoint TTL sweep and user_metadata bounds",
    "sessions": "[sessions] when idle client sessions end (their runs unloaded, samplers released)",
    "runs": "[runs] what survives a restart: automatic saves, the shutdown bound",
    "workers": "[workers] scale-out: run every training engine on a worker group (default: in process)",
    "parallel": "[parallel] layout of every engine on the worker group",
    "log": "[log] what the server logs beyond --log-level",
}


@dataclass
class ServeConfig:
    """Everything `ember serve` takes.

    log_level: the server's log level (debug also logs every HTTP request).
    """

    server: ServerConfig = field(default_factory=ServerConfig, metadata=meta(flat=True))
    service: ServiceConfig = field(default_factory=ServiceConfig, metadata=meta(flat=True))
    workers: WorkersConfig = field(default_factory=WorkersConfig, metadata=meta(flat=True))
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        # a retrieve wait ends with the server's long-poll (below the SDK's read timeout)
        self.service.retrieve_max_wait_s = self.server.long_poll_s

    def check_backend(self) -> None:
        """ValueError when the sampler backend cannot be imported here: at start-up, not at
        the first sample. Apart from the other checks because it imports the backend (torch,
        vLLM): `ember serve` first answers what needs no heavy import (port, data directory)."""
        from ember.sampling.registry import backend_missing

        reason = backend_missing(self.service.sampler.backend)
        if reason:
            raise ValueError(f"sampler.backend: {reason}")
