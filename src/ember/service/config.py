"""`ServiceConfig`: what the multi-tenant service needs besides its collaborators."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.config import meta
from ember.engine.config import EngineConfig
from ember.sampling.config import SamplerConfig
from ember.service.limits import Limits


def load_models_toml(path: str | os.PathLike) -> dict[str, str]:
    """Read base-model registrations from TOML: either a `[models]` table or top-level
    `name = "dir"` pairs. Relative directories are resolved against the file's folder."""
    p = Path(path)
    with p.open("rb") as f:
        doc = tomllib.load(f)
    table = doc.get("models", doc)
    out: dict[str, str] = {}
    for name, value in table.items():
        if not isinstance(value, str):
            raise ValueError(f"{p}: model {name!r} must map to a directory string, got {type(value).__name__}")
        d = Path(value).expanduser()
        out[name] = str(d if d.is_absolute() else (p.parent / d).resolve())
    return out


def check_model_dirs(models: Mapping[str, str]) -> None:
    """Every registered model must be a model directory now, not at its first use."""
    for name, directory in models.items():
        d = Path(directory).expanduser()
        if not d.is_dir():
            raise ValueError(f"model {name!r}: directory {str(d)!r} does not exist")
        if not (d / "config.json").is_file():
            raise ValueError(f"model {name!r}: {str(d)!r} is not a model directory (no config.json)")


def check_model_root(root: str | os.PathLike, what: str = "model root") -> Path:
    d = Path(root).expanduser()
    if not d.is_dir():
        raise ValueError(f"{what} {str(d)!r} is not a directory")
    return d.resolve()


@dataclass
class DurabilityConfig:
    """How every future reaches an end when the database or the disk fails (`[durability]`).

    db_lock_timeout_s: how long one database statement waits for a lock that another
        connection holds (SQLite's busy timeout, PostgreSQL's lock_timeout) before failing.
    finish_retry_s: finishing a future retries a failing database write (locked, disk
        full, connection lost) for this long; then the future ends as a `server` failure
        that says why (kept in memory, written once the database recovers). A future so
        ends at most finish_retry_s + 2 x db_lock_timeout_s after its work did (the last
        attempt may wait for its turn among this process's writers, then for the lock).
    future_deadline_s: a future still pending this long after it was accepted is ended
        (`server`) by the periodic sweep (None = never).
    orphan_grace_s: pending rows with no work behind them in this server lifetime (left
        by a crash) are ended by the sweep once this old.
    """

    db_lock_timeout_s: float = 5.0
    finish_retry_s: float = 10.0
    future_deadline_s: float | None = 24 * 3600.0
    orphan_grace_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("db_lock_timeout_s", "finish_retry_s", "orphan_grace_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DurabilityConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.future_deadline_s is not None and not self.future_deadline_s > 0:
            raise ValueError(f"DurabilityConfig.future_deadline_s must be > 0 or None, got {self.future_deadline_s}")


TEN_YEARS_S = 10 * 365 * 24 * 3600
DAY_S = 24 * 3600.0
MIB = 1 << 20


@dataclass
class StabilityConfig:
    """Expiry and memory bounds of the stability records (`[stability]`).

    ttl_s: a record lives this long after its last use (sampling or training; Tinker:
        one day).
    max_bytes_per_owner: memory bound per API key in real bytes (`SequenceRecord.nbytes`:
        ~700 bytes per record plus 8 bytes per sampled token and the record's share of its
        prompt's 4 bytes per token); over it, the key's least recently used go first.
    max_bytes_total: the same bound for all keys together. The defaults (256 MiB per key,
        1 GiB in all) fit a default machine. A mixture-of-experts sample's record also
        holds its routes (2 bytes per token, layer and expert per token).
    routing_replay: the default of `loss_fn_config["routing_replay"]`: route the tokens of
        datums whose provenance names recorded samples of a mixture-of-experts model
        through the experts the sampler chose (`ember.service.routing_records`).
    """

    ttl_s: float = DAY_S
    max_bytes_per_owner: int = 256 * MIB
    max_bytes_total: int = 1024 * MIB
    routing_replay: bool = False

    def __post_init__(self) -> None:
        if not self.ttl_s > 0:
            raise ValueError(f"StabilityConfig.ttl_s must be > 0, got {self.ttl_s}")
        for name in ("max_bytes_per_owner", "max_bytes_total"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"StabilityConfig.{name} must be an integer >= 1, got {value!r}")


@dataclass
class CheckpointConfig:
    """Checkpoint expiry (TTL) and the metadata a save may attach (`[checkpoints]`).

    sweep_interval_s: how often the server deletes checkpoints past their expiry (files
        and row). An expired checkpoint is gone for every call (404, as if never saved)
        from its expiry on, before the sweep removes its files too.
    max_ttl_s: the largest `ttl_seconds` a save or `set_checkpoint_ttl_from_tinker_path`
        accepts (default 10 years, as Tinker); the smallest is 1 (Tinker's hosted
        service asks for at least 3600 on set_checkpoint_ttl; ember takes shorter ones).
    max_metadata_entries: entries of a save's `user_metadata` (string keys and values).
    max_metadata_key_chars: characters of one `user_metadata` key.
    max_metadata_value_chars: characters of one `user_metadata` value.
    """

    sweep_interval_s: float = 60.0
    max_ttl_s: int = field(default=TEN_YEARS_S, metadata=meta(limit=True))
    max_metadata_entries: int = field(default=64, metadata=meta(limit=True))
    max_metadata_key_chars: int = field(default=128, metadata=meta(limit=True))
    max_metadata_value_chars: int = field(default=4096, metadata=meta(limit=True))

    def __post_init__(self) -> None:
        if not self.sweep_interval_s > 0:
            raise ValueError(f"checkpoints.sweep_interval_s must be > 0, got {self.sweep_interval_s}")
        for name in ("max_ttl_s", "max_metadata_entries", "max_metadata_key_chars", "max_metadata_value_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"checkpoints.{name} must be an integer >= 1, got {value!r}")


@dataclass
class SessionsConfig:
    """When client sessions end by themselves (`[sessions]`, `--sessions.*`).

    heartbeat_timeout_s: a session whose client sent no heartbeat for this long is ended:
        the client is gone (killed, crashed, its machine lost). Its training runs are saved
        first (`tinker://<run>/weights/session-end`, training state with the optimizer,
        resumable with create_training_client_from_state_with_optimizer), then unloaded;
        its samplers released; its quota freed. The SDK sends a heartbeat every 10 s from
        a background thread for as long as the client object lives and warns after 120 s
        without one; the default, 300 s, is 30 missed heartbeats. None = never.

    idle_ttl_s: a session that no request has named (itself, one of its training runs or
        sampling sessions) for this long, with nothing of it pending, is ended: its runs
        are saved and unloaded as above and its samplers released, and its client's next
        call is told so.
        Heartbeats do not count (the SDK sends them for as long as the client object
        lives). Default 2 hours: a training loop names its session every step, and a
        run left untouched that long on a shared server holds memory others wait for
        (recreate it from its last checkpoint). None = never.
    """

    heartbeat_timeout_s: float | None = 300.0
    idle_ttl_s: float | None = 2 * 3600.0

    def __post_init__(self) -> None:
        for name in ("heartbeat_timeout_s", "idle_ttl_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise ValueError(f"sessions.{name} must be > 0 seconds or None, got {value!r}")


@dataclass
class RunsConfig:
    """What survives a restart of `ember serve` (`[runs]`, `--runs.*`; README "Restarts").

    autosave_every_steps: every this many optim_steps a loaded run's full state (weights,
        optimizer, step, next seq_id) is saved as its automatic checkpoint
        (`tinker://<run>/weights/ember-autosave`, one per run, replaced each time, outside
        the checkpoint bytes quota): what a run comes back from after the server was killed
        (SIGKILL, power loss). 0 = off (a clean stop, SIGTERM or Ctrl-C, saves every run anyway);
        cost: `benchmarks/autosave.py`.
    save_on_shutdown: on SIGTERM/SIGINT, save every loaded run so that it comes back on its
        next request after a restart (off: a stop unloads them, as a crash would).
    shutdown_drain_s: on SIGTERM/SIGINT, how long requests already accepted may take to
        finish before the rest fail (category server: resubmit them) and every loaded run is
        saved; the saves themselves are waited for as long again.
    """

    autosave_every_steps: int = 0
    save_on_shutdown: bool = True
    shutdown_drain_s: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.autosave_every_steps, bool) or not isinstance(self.autosave_every_steps, int) \
                or self.autosave_every_steps < 0:
            raise ValueError(f"runs.autosave_every_steps must be an integer >= 0, got {self.autosave_every_steps!r}")
        if isinstance(self.shutdown_drain_s, bool) or not self.shutdown_drain_s >= 0:
            raise ValueError(f"runs.shutdown_drain_s must be >= 0 seconds, got {self.shutdown_drain_s!r}")


@dataclass
class ServiceConfig:
    """Configuration of one `Service`.

    data_dir: root of checkpoints (`<data_dir>/checkpoints/...`), sampler scratch files
        and, by default, the SQLite database `<data_dir>/ember.db`.
    models: base-model registry, name -> local directory (`--model NAME=DIR`); each must
        be a model directory (with a config.json), checked here.
    model_roots: directories under which a model directory may also be named by its path
        (`--model-root DIR`; none by default). The data directory is never reachable by
        path, whatever the roots.
    image_roots: directories under which an `ImageAssetPointerChunk.location` may name a
        local file (`--image-root DIR`; none by default: every pointer is refused). The same
        realpath rules as model_roots: symlinks and `..` resolved first, never the data
        directory, never a URL (`ember.service.images`).
    models_toml: optional TOML file with more registrations (merged; `models` wins).
    database_url: any SQLAlchemy URL (e.g. postgresql+psycopg://...); None = SQLite file.
    engine: EngineConfig given to every training engine.
    sampler: the samplers' `SamplerConfig` (None = its defaults). Its max_lora_rank is
        `limits.max_lora_rank`: a run the limit admits is one every sampler can load.
        Its batch_invariant follows `engine.batch_invariant` (one setting for both sides).
    seq_gap_timeout_s: how long a run waits for a missing seq_id before skipping it.
    retrieve_max_wait_s: cap on one `retrieve` wait (the server long-polls below the SDK's
        45 s read timeout).
    max_samplers_per_session: sampling sessions (weight versions) kept loaded per client
        session; older ones are evicted (reloaded from disk on use if they have a path).
    future_retention_s: finished futures (and their stored results) are deleted this long
        after they finished (None = kept forever).
    housekeeping_interval_s: how often session expiry and future pruning are applied
        (checkpoint TTLs: `checkpoints.sweep_interval_s`).
    limits: per-request bounds on counts and sizes (`ember.service.limits.Limits`).
    durability: database lock waits, future-finishing retries and the stuck-future sweep
        (`DurabilityConfig`).
    stability: expiry and memory bounds of the records `record_stability_info=True` samples
        keep for `stable_reinforce` (`StabilityConfig`; the records: `ember.service.stability`).
    checkpoints: checkpoint TTL sweep and bounds of ttl_seconds / user_metadata
        (`CheckpointConfig`).
    sessions: when client sessions end by themselves: no heartbeat, or idle (`SessionsConfig`).
    runs: automatic saves and the shutdown bound of training runs (`RunsConfig`).
    metric_history_rows: per-step metric rows kept per training run (the console's
        curves; one row per forward_backward / forward / optim_step). Past it the older
        half of the run's steps is thinned to every second step (`ember.service.metric_history`).
        0 = no history recorded.
    """

    data_dir: str | os.PathLike = "./ember-data"
    models: Mapping[str, str] = field(default_factory=dict, metadata=meta(aliases=["model"]))
    models_toml: str | os.PathLike | None = None
    model_roots: Sequence[str | os.PathLike] = field(default=(), metadata=meta(aliases=["model_root"]))
    image_roots: Sequence[str | os.PathLike] = field(default=(), metadata=meta(aliases=["image_root"]))
    database_url: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    seq_gap_timeout_s: float = 5.0
    # `ember serve` sets it from the server's long_poll_s: not a setting of its own
    retrieve_max_wait_s: float = field(default=25.0, metadata=meta(hidden=True))
    max_samplers_per_session: int = 32
    future_retention_s: float | None = 7 * 24 * 3600.0
    housekeeping_interval_s: float = 30.0
    limits: Limits = field(default_factory=Limits)
    durability: DurabilityConfig = field(default_factory=DurabilityConfig)
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    sessions: SessionsConfig = field(default_factory=SessionsConfig)
    runs: RunsConfig = field(default_factory=RunsConfig)
    metric_history_rows: int = 4096

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).expanduser().resolve()
        models = dict(load_models_toml(self.models_toml)) if self.models_toml else {}
        models.update({str(k): str(v) for k, v in dict(self.models).items()})
        self.models = models
        check_model_dirs(models)
        self.model_roots = [check_model_root(r) for r in self.model_roots]
        self.image_roots = [check_model_root(r, "image root") for r in self.image_roots]
        if isinstance(self.limits, Mapping):
            self.limits = Limits(**self.limits)
        if isinstance(self.durability, Mapping):
            self.durability = DurabilityConfig(**self.durability)
        if isinstance(self.stability, Mapping):
            self.stability = StabilityConfig(**self.stability)
        if isinstance(self.checkpoints, Mapping):
            self.checkpoints = CheckpointConfig(**self.checkpoints)
        if isinstance(self.sessions, Mapping):
            self.sessions = SessionsConfig(**self.sessions)
        self.sampler = self.sampler or SamplerConfig()
        if self.engine.compile and not self.engine.compile_cache_dir:  # a restart reads the compiled graphs back
            self.engine = dataclasses.replace(self.engine, compile_cache_dir=str(self.data_dir / "compile-cache"))
        if self.engine.batch_invariant and not self.sampler.batch_invariant:  # one setting: both sides or neither
            self.sampler = dataclasses.replace(self.sampler, batch_invariant=True)
        if self.sampler.max_lora_rank != self.limits.max_lora_rank:
            self.sampler = dataclasses.replace(self.sampler, max_lora_rank=self.limits.max_lora_rank)
        if self.seq_gap_timeout_s <= 0:
            raise ValueError(f"ServiceConfig.seq_gap_timeout_s must be > 0, got {self.seq_gap_timeout_s}")
        if self.max_samplers_per_session < 1:
            raise ValueError(f"ServiceConfig.max_samplers_per_session must be >= 1, got {self.max_samplers_per_session}")
        if self.future_retention_s is not None and self.future_retention_s <= 0:
            raise ValueError(f"ServiceConfig.future_retention_s must be > 0 or None, got {self.future_retention_s}")
        if self.housekeeping_interval_s <= 0:
            raise ValueError(f"ServiceConfig.housekeeping_interval_s must be > 0, got {self.housekeeping_interval_s}")
        if isinstance(self.metric_history_rows, bool) or not (
                self.metric_history_rows == 0 or self.metric_history_rows >= 8):
            raise ValueError(f"ServiceConfig.metric_history_rows must be 0 (off) or >= 8, got {self.metric_history_rows!r}")
        if self.retrieve_max_wait_s < 0:
            raise ValueError(f"ServiceConfig.retrieve_max_wait_s must be >= 0, got {self.retrieve_max_wait_s}")

    @property
    def resolved_database_url(self) -> str:
        from ember.service.store import default_database_url

        return self.database_url or default_database_url(self.data_dir)


def worker_runtimes() -> tuple[str, ...]:
    """"local" (in-process engines) and every worker runtime of ember.workers' registry."""
    from ember.workers.group import RUNTIMES

    return ("local", *RUNTIMES)


@dataclass
class WorkersConfig:
    """Where the service's training engines run (`ember serve --workers.* --parallel.*`).

    runtime: "local" (default) = in-process TorchEngines, LoRA adapters sharing one base
        model (`LocalEngineFactory`); "inline" | "process" | "ray" = every training run is
        one SPMD engine on all ranks of one `ember.workers.WorkerGroup`
        (`WorkerGroupEngineFactory`). `ember serve` reads these from `[workers]` and the
        parallel dims from `[parallel]`.
    world_size: ranks of the group (local/inline: exactly 1).
    ray_address: runtime "ray" only: join this cluster ("auto", "ray://host:10001");
        None starts a local Ray instance.
    dp_replicate / dp_shard / cp / tp: the `ParallelismConfig` of every engine. Unset dims
        default to 1, except dp_shard, which takes the ranks left over, so the default
        is FSDP2 over all ranks. The product must equal world_size. cp (context
        parallelism, Ulysses attention, `ember.engine.context_parallel`) splits each
        sequence over cp ranks; cp x tp must divide every served model's attention
        heads (cp splits the heads each TP rank holds).
    ep: expert parallelism for mixture-of-experts models, taken from dp_shard's ranks
        (adds none; must divide dp_shard; `ember.engine.expert_parallel`).
    call_timeout_s: a group call that takes longer breaks the group (a hung rank).

    Samplers stay in the service's process and receive the engines' weights (gathered
    on rank 0) when a sampling client is made from a training run.
    """

    runtime: str = field(default="local", metadata=meta(section="workers"))
    world_size: int = field(default=1, metadata=meta(section="workers"))
    ray_address: str | None = field(default=None, metadata=meta(section="workers"))
    dp_replicate: int | None = field(default=None, metadata=meta(section="parallel"))
    dp_shard: int | None = field(default=None, metadata=meta(section="parallel"))
    tp: int | None = field(default=None, metadata=meta(section="parallel"))
    cp: int | None = field(default=None, metadata=meta(section="parallel"))
    ep: int | None = field(default=None, metadata=meta(section="parallel"))
    call_timeout_s: float = field(default=600.0, metadata=meta(section="workers"))

    def __post_init__(self) -> None:
        if self.runtime not in worker_runtimes():
            raise ValueError(f"workers.runtime must be one of {', '.join(worker_runtimes())}, got {self.runtime!r}")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"workers.world_size must be an integer >= 1, got {self.world_size!r}")
        if self.runtime in ("local", "inline") and self.world_size != 1:
            raise ValueError(f"workers.runtime {self.runtime!r} has exactly one rank, got workers.world_size="
                             f"{self.world_size}; use --workers.runtime process or ray for more")
        if self.ray_address is not None and self.runtime != "ray":
            raise ValueError(f"workers.ray_address is only used with workers.runtime 'ray', not {self.runtime!r}")
        if self.runtime == "local" and self.parallel_dims_given:
            raise ValueError("parallel dims (--parallel.*) need a worker group: set workers.runtime to "
                             "inline, process or ray")
        if self.call_timeout_s <= 0:
            raise ValueError(f"workers.call_timeout_s must be > 0, got {self.call_timeout_s}")
        self.parallel_dims()  # validates the layout against world_size

    @property
    def parallel_dims_given(self) -> bool:
        return any(v is not None for v in (self.dp_replicate, self.dp_shard, self.cp, self.tp, self.ep))

    def parallel_dims(self) -> dict[str, int]:
        """{dp_replicate, dp_shard, tp} (and cp when > 1, as `ParallelismConfig.as_dict`
        lists it) with the defaults filled in, the keyword arguments of every engine's
        `ParallelismConfig`; ValueError naming the key if they do not multiply to world_size."""
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "ep"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"parallel.{name} must be an integer >= 1, got {value!r}")
        rep, cp, tp = self.dp_replicate or 1, self.cp or 1, self.tp or 1
        shard = self.dp_shard
        if shard is None:
            if self.world_size % (rep * cp * tp):
                raise ValueError(f"parallel.dp_replicate={rep} x parallel.cp={cp} x parallel.tp={tp} does not "
                                 f"divide workers.world_size={self.world_size}")
            shard = self.world_size // (rep * cp * tp)
        if rep * shard * cp * tp != self.world_size:
            raise ValueError(f"parallel.dp_replicate={rep} x parallel.dp_shard={shard} x parallel.cp={cp} x "
                             f"parallel.tp={tp} = {rep * shard * cp * tp} ranks, but workers.world_size="
                             f"{self.world_size}")
        ep = self.ep or 1
        if shard % ep:
            raise ValueError(f"parallel.ep={ep} must divide parallel.dp_shard={shard} (expert parallelism takes "
                             "its ranks from dp_shard)")
        return ({"dp_replicate": rep, "dp_shard": shard, "tp": tp} | ({"cp": cp} if cp > 1 else {})
                | ({"ep": ep} if ep > 1 else {}))
