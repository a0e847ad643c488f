"""Training runs: creation (fresh or from a checkpoint), ordered ops, checkpoints.

A live run is a `LiveRun`: its spec, its lane (shared by every LoRA run of one base
model), its `RunSequencer` and, once created on the lane, its engine. Every op is
executed on the lane by `execute`, which turns the outcome into a finished future:
ValueError (bad input, with the engine's message) and NonFiniteGradientError are `user`
failures; anything else is a `server` failure, logged with its traceback. A failing op
never stops the lane or the run.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinker import types

from ember import failpoints
from ember.engine.base import NonFiniteGradientError, TrainingEngine
from ember.service import checkpoints as ckpt
from ember.service import external, lifecycle
from ember.service.config import CheckpointConfig
from ember.service.api import NotFoundError, RequestType, Submission, UserError
from ember.service.faults import public_message
from ember.service.engines import BaseModel, EngineFactory, ModelRegistry, RunSpec
from ember.service.futures import Server, User, FutureTable
from ember.service.sequencer import Lane, RunSequencer
from ember.service.limits import Limits
from ember.service.store import CheckpointRow, RunRow, Store

log = logging.getLogger(__name__)

RESTARTED = (
    "training run {run} is not loaded: the server restarted (or its session ended) since it was created. "
    "Recreate it from its last checkpoint with create_training_client_from_state[_with_optimizer]"
)


class RunNotLoadedError(Exception):
    """The run exists in the database but has no engine in this server lifetime."""


@dataclass
class LiveRun:
    run_id: str
    owner: str
    session_id: str
    spec: RunSpec
    lane: Lane
    seq: RunSequencer
    engine: TrainingEngine | None = None
    error: str | None = None  # why creation failed
    touched: float = 0.0  # last time last_request_time was written
    lock: threading.Lock = field(default_factory=threading.Lock)

    def require_engine(self) -> TrainingEngine:
        if self.engine is None:
            raise UserError(f"training run {self.run_id} could not be created: {self.error or 'not ready'}")
        return self.engine


def classify(exc: BaseException) -> tuple[str, types.RequestErrorCategory]:
    if isinstance(exc, NonFiniteGradientError):
        return str(exc), User
    if isinstance(exc, ValueError):  # includes UserError: bad input, the engine names datum/field
        return str(exc), User
    return public_message(exc), Server


def validate_lora(cfg: types.LoraConfig | None) -> None:
    if cfg is None:
        return
    if not isinstance(cfg.rank, int) or cfg.rank < 1:
        raise UserError(f"lora_config.rank must be an integer >= 1, got {cfg.rank!r}")
    if not (cfg.train_attn or cfg.train_mlp or cfg.train_unembed):
        raise UserError("lora_config must train at least one of attn, mlp, unembed")


def validate_head(user_metadata: Mapping[str, Any] | None) -> str:
    """The run's head, from `user_metadata["ember.head"]` ("policy" when absent)."""
    from ember.engine.heads import head_from_metadata

    try:
        return head_from_metadata(user_metadata)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def check_samplable(spec: RunSpec) -> None:
    """Only a policy has a sampler: a value head outputs a number per token, not a distribution
    over tokens, and its adapter on the LM would sample from something nobody trained."""
    if spec.head != "policy":
        raise UserError(f"run {spec.run_id} has a {spec.head!r} head (user_metadata['ember.head']): it outputs "
                        "values, not tokens, so it has no sampler; read its values with forward, save it with "
                        "save_state or save_weights_external")


def _saved_head(directory, user_metadata: Mapping[str, Any] | None) -> str:
    """The head of a run created from a training checkpoint: the checkpoint's (it holds the
    head's weights). Metadata naming another head is refused rather than ignored."""
    from ember.engine.checkpoint import read_meta
    from ember.engine.heads import HEAD_METADATA_KEY

    try:
        saved = read_meta(Path(directory)).get("head", "policy")
    except (OSError, ValueError):
        saved = "policy"  # load_state reports the unreadable checkpoint itself
    if user_metadata and HEAD_METADATA_KEY in user_metadata and validate_head(user_metadata) != saved:
        raise UserError(f"user_metadata[{HEAD_METADATA_KEY!r}] is {user_metadata[HEAD_METADATA_KEY]!r}, but the "
                        f"checkpoint holds a {saved!r}-head run; leave the key out or set it to {saved!r}")
    return saved


def _saved_optimizer(directory) -> dict[str, Any]:
    """The optimizer config a training checkpoint's state belongs to (AdamW for older ones)."""
    from ember.engine.checkpoint import read_meta

    try:
        kind = read_meta(Path(directory)).get("optimizer", "adamw")
    except (OSError, ValueError):
        kind = "adamw"  # load_state reports the unreadable checkpoint itself
    return validate_optimizer({"type": kind})


def _resumed_optimizer(directory, with_state: bool, requested: Mapping[str, Any] | None) -> dict[str, Any]:
    """The optimizer of a run created from a checkpoint: the saved one with its state, or
    the requested one (default AdamW) started fresh."""
    if not with_state:
        return validate_optimizer(requested)
    saved = _saved_optimizer(directory)
    if requested is not None and validate_optimizer(requested)["type"] != saved["type"]:
        raise UserError(f"optimizer_config: the checkpoint's optimizer state is {saved['type']!r}, "
                        f"got a {requested.get('type')!r} config; load it without optimizer state to switch")
    return saved


def validate_optimizer(cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """The run's optimizer config: AdamW (default) or Dimuon version 1, nothing else."""
    from ember.engine.optimizers import OPTIMIZERS

    cfg = dict(cfg or {"type": "adamw"})
    kind = cfg.pop("type", "adamw")
    if kind not in OPTIMIZERS:
        raise UserError(f"optimizer {kind!r} is not supported by ember; use {{'type': 'adamw'}} or {{'type': 'dimuon'}}")
    if kind == "dimuon" and cfg.pop("version", 1) != 1:
        raise UserError("optimizer 'dimuon': only version 1 is supported")
    if cfg:
        raise UserError(f"optimizer {kind!r}: unknown fields {sorted(cfg)}")
    return {"type": kind, "version": 1} if kind == "dimuon" else {"type": "adamw"}


def model_arch(directory: Path) -> str | None:
    try:
        return json.loads((directory / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


class RunManager:
    """Creates runs, queues their ops in seq_id order and executes them on lanes."""

    def __init__(
        self, store: Store, futures: FutureTable, registry: ModelRegistry, factory: EngineFactory,
        data_dir: Path, gap_timeout_s: float, limits: Limits | None = None,
        checkpoints: CheckpointConfig | None = None,
    ) -> None:
        self.store, self.futures, self.registry, self.factory = store, futures, registry, factory
        self.data_dir = data_dir
        self.gap_timeout_s = gap_timeout_s
        self.limits = limits or Limits()
        self.checkpoint_config = checkpoints or CheckpointConfig()
        self._runs: dict[str, LiveRun] = {}
        self._lanes: dict[str, Lane] = {}
        self._lane_users: dict[str, int] = {}  # lane key -> runs (live or draining) that may still use it
        self._lock = threading.Lock()
        # Colocation (SamplerConfig.colocate): called on the run's lane around every op, so
        # the samplers sleep and the engine is on its device while it trains, offloaded after.
        self.before_op: Callable[[LiveRun], None] | None = None
        self.after_op: Callable[[LiveRun], None] | None = None

    # ------------------------------------------------------------------ plumbing
    def reject(self, owner: str, rtype: RequestType, error: str, category=User, model_id: str | None = None) -> Submission:
        """Accept a request only to fail it (semantic errors are failed futures, not HTTP errors)."""
        sub, _ = self.futures.create(owner, rtype, model_id=model_id)
        self.futures.fail(sub.request_id, error, category)
        return sub

    def execute(self, request_id: str, fn: Callable[[], Any]) -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - every outcome must end the future
            msg, cat = classify(exc)
            if cat == Server:
                log.exception("request %s failed", request_id)
            self.futures.fail(request_id, msg, cat)
        else:
            self.futures.complete(request_id, result)

    def _acquire_lane_locked(self, spec: RunSpec) -> Lane:
        """The lane of `spec` (created on first use); counts the run as one of its users."""
        key = self.factory.lane_key(spec)
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = Lane(f"{len(self._lanes)}")
        self._lane_users[key] = self._lane_users.get(key, 0) + 1
        return lane

    def live(self, owner: str, model_id: str) -> LiveRun:
        with self._lock:
            run = self._runs.get(model_id)
        if run is not None and run.owner == owner:
            return run
        row = self.store.get(RunRow, model_id)
        if row is None or row.owner != owner:
            raise NotFoundError(f"unknown model_id {model_id!r}")
        raise RunNotLoadedError(RESTARTED.format(run=model_id))

    # ------------------------------------------------------------------ creation
    def _register(self, owner: str, session_id: str, model_seq_id: int, spec: RunSpec, next_seq: int,
                  optimizer: dict, user_metadata, created_from: str | None) -> LiveRun:
        now = time.time()
        self.store.add(
            RunRow(
                id=spec.run_id, owner=owner, session_id=session_id, model_seq_id=model_seq_id,
                base_model=spec.base.name, is_lora=spec.is_lora,
                lora_config=spec.lora_config.model_dump() if spec.lora_config else None,
                optimizer_config=optimizer, user_metadata=dict(user_metadata or {}) or None,
                created_from=created_from, status="active", created_at=now, last_request_time=now,
            )
        )
        with self._lock:
            lane = self._acquire_lane_locked(spec)
            run = LiveRun(spec.run_id, owner, session_id, spec, lane,
                          RunSequencer(spec.run_id, lane, self.gap_timeout_s, next_seq))
            self._runs[spec.run_id] = run
        return run

    def _build_engine(self, run: LiveRun) -> None:
        try:
            run.engine = self.factory.create(run.spec)
        except BaseException as exc:
            run.error = classify(exc)[0]
            self.store.update(RunRow, run.run_id, status="failed")
            raise
        spec = run.spec
        log.info("run %s created for %s: base model %s, %s, %s head", run.run_id, run.owner, spec.base.name,
                 f"LoRA rank {spec.lora_config.rank}" if spec.is_lora else "full fine-tuning", spec.head)

    def create_model(self, owner: str, session_id: str, model_seq_id: int, base_model: str,
                     lora_config: types.LoraConfig | None, optimizer_config, user_metadata) -> Submission:
        run_id = f"{session_id}:train:{model_seq_id}"
        sub, created = self.futures.create(owner, "CreateModel", model_id=run_id, dedup_key=f"create:{run_id}")
        if not created:
            return sub
        with self.futures.accepting(sub.request_id):
            self._start_create(sub, owner, session_id, model_seq_id, base_model, lora_config, optimizer_config,
                               user_metadata)
        return sub

    def _start_create(self, sub: Submission, owner: str, session_id: str, model_seq_id: int, base_model: str,
                      lora_config: types.LoraConfig | None, optimizer_config, user_metadata) -> None:
        run_id = f"{session_id}:train:{model_seq_id}"
        try:
            if not isinstance(model_seq_id, int) or model_seq_id < 0:
                raise UserError(f"model_seq_id must be an integer >= 0, got {model_seq_id!r}")
            validate_lora(lora_config)
            self.limits.check_lora_rank(lora_config)
            optimizer = validate_optimizer(optimizer_config)
            spec = RunSpec(run_id, self.registry.resolve(base_model), lora_config, optimizer["type"],
                           validate_head(user_metadata))
            if self.store.get(RunRow, run_id) is not None:
                raise UserError(f"model {run_id} already exists (model_seq_id {model_seq_id} reused in this session)")
            run = self._register(owner, session_id, model_seq_id, spec, 1, optimizer, user_metadata, None)
        except UserError as exc:
            self.futures.fail(sub.request_id, str(exc), User)
            return

        def op() -> types.CreateModelResponse:
            self._build_engine(run)
            return types.CreateModelResponse(model_id=run_id)

        run.lane.submit(lambda: self.execute(sub.request_id, op))

    def _checkpoint(self, owner: str, path: str, kind: str | None = None) -> tuple[ckpt.TinkerPath, CheckpointRow]:
        tpath, row = lifecycle.readable(self.store, owner, path)  # the owner's, or a published one
        if kind is not None and tpath.kind != kind:
            raise UserError(
                f"checkpoint {path!r} holds sampler weights only; load training state from a "
                "tinker://<run>/weights/<name> path (written by save_state)"
            )
        return tpath, row

    def create_from_checkpoint(self, owner: str, session_id: str, model_seq_id: int, path: str, optimizer: bool,
                               base_model: str | None, user_metadata, optimizer_config=None) -> Submission:
        run_id = f"{session_id}:train:{model_seq_id}"
        sub, created = self.futures.create(owner, "LoadWeights", model_id=run_id, dedup_key=f"create:{run_id}")
        if not created:
            return sub
        with self.futures.accepting(sub.request_id):
            self._start_create_from(sub, owner, session_id, model_seq_id, path, optimizer, base_model, user_metadata,
                                    optimizer_config)
        return sub

    def _start_create_from(self, sub: Submission, owner: str, session_id: str, model_seq_id: int, path: str,
                           optimizer: bool, base_model: str | None, user_metadata, optimizer_config=None) -> None:
        run_id = f"{session_id}:train:{model_seq_id}"
        try:
            if not isinstance(model_seq_id, int) or model_seq_id < 0:
                raise UserError(f"model_seq_id must be an integer >= 0, got {model_seq_id!r}")
            tpath, crow = self._checkpoint(owner, path, "training")
            src = self.store.get(RunRow, crow.run_id)
            lora = types.LoraConfig(**src.lora_config) if src is not None and src.lora_config else None
            base = self.registry.resolve(base_model or (src.base_model if src else ""))
            if self.store.get(RunRow, run_id) is not None:
                raise UserError(f"model {run_id} already exists (model_seq_id {model_seq_id} reused in this session)")
            opt = _resumed_optimizer(crow.directory, optimizer, optimizer_config)
            spec = RunSpec(run_id, base, lora, opt["type"], _saved_head(crow.directory, user_metadata))
            run = self._register(owner, session_id, model_seq_id, spec, 0, opt, user_metadata, tpath.uri)
        except UserError as exc:
            self.futures.fail(sub.request_id, str(exc), User)
            return

        def op() -> types.LoadWeightsResponse:
            self._build_engine(run)
            run.engine.load_state(crow.directory, optimizer=optimizer)
            return types.LoadWeightsResponse(path=tpath.uri, model_id=run_id)

        run.seq.offer(0, lambda: self.execute(sub.request_id, op), lambda r: self.futures.fail(sub.request_id, r, Server))

    # ------------------------------------------------------------------ ordered ops
    def submit_op(self, owner: str, model_id: str, seq_id: Any, rtype: RequestType,
                  fn: Callable[[LiveRun], Any]) -> Submission:
        """Queue `fn(run)` as request `seq_id` of `model_id` (idempotent on (model_id, seq_id))."""
        if not isinstance(seq_id, int) or isinstance(seq_id, bool) or seq_id < 0:
            return self.reject(owner, rtype, f"seq_id must be an integer >= 0, got {seq_id!r}", model_id=model_id)
        sub, created = self.futures.create(owner, rtype, model_id=model_id, dedup_key=f"op:{model_id}:{seq_id}")
        if created:
            with self.futures.accepting(sub.request_id):
                self._queue_op(sub.request_id, owner, model_id, seq_id, fn)
        return sub

    def _queue_op(self, rid: str, owner: str, model_id: str, seq_id: int, fn: Callable[[LiveRun], Any]) -> None:
        try:
            run = self.live(owner, model_id)
            # before the sequencer holds it: a far-ahead seq_id would wait, then skip the gap
            self.limits.check_seq_ahead(seq_id, run.seq.next_seq, model_id)
        except (NotFoundError, UserError) as exc:
            self.futures.fail(rid, str(exc), User)
            return
        except RunNotLoadedError as exc:
            self.futures.fail(rid, str(exc), Server)
            return
        self._touch(run)
        run.seq.offer(seq_id, lambda: self.execute(rid, lambda: self._run_op(run, fn)),
                      lambda r: self.futures.fail(rid, r, Server))

    def _run_op(self, run: LiveRun, fn: Callable[[LiveRun], Any]) -> Any:
        if self.before_op is not None:
            self.before_op(run)
        try:
            return fn(run)
        finally:
            if self.after_op is not None:
                self.after_op(run)

    def _touch(self, run: LiveRun) -> None:
        """Record the run's last request time (at most once a second: it is only for listings)."""
        now = time.time()
        if now - run.touched >= 1.0:
            run.touched = now
            try:
                self.store.update(RunRow, run.run_id, last_request_time=now)
            except Exception as exc:  # noqa: BLE001 - a listing's timestamp must not fail the request
                log.warning("run %s: last_request_time not recorded (%s)", run.run_id, public_message(exc))

    # ------------------------------------------------------------------ checkpoint ops (run on the lane)
    def save_checkpoint(self, run: LiveRun, name: Any, kind: str, overwrite: bool, ttl_seconds, user_metadata) -> str:
        """Write a fresh directory, commit the row naming it, then drop the replaced one
        (crash-consistent: see `ember.service.checkpoints`). A save that replaces a
        checkpoint makes a new one: private, with this save's TTL and metadata."""
        engine = run.require_engine()
        tpath = ckpt.TinkerPath(run.run_id, kind, ckpt.validate_name(name))
        ttl = lifecycle.check_ttl(ttl_seconds, self.checkpoint_config)
        meta = lifecycle.check_metadata(user_metadata, self.checkpoint_config)
        existing = self.store.get(CheckpointRow, tpath.uri)
        if existing is not None and not overwrite and not lifecycle.expired(existing):
            raise UserError(f"checkpoint {tpath.uri} already exists; pass overwrite=True to replace it")
        final = ckpt.new_version_dir(self.data_dir, tpath)
        tmp = ckpt.temp_dir_of(final)
        failpoints.hit("checkpoint.before_write")
        try:
            self._write_checkpoint(run, engine, kind, tpath.name, tmp)
            ckpt.publish(tmp, final)
        finally:
            ckpt.remove_dir(tmp)
        failpoints.hit("checkpoint.after_write")
        now = time.time()
        row = CheckpointRow(
            tinker_path=tpath.uri, run_id=run.run_id, owner=run.owner, kind=kind, name=tpath.name, directory=str(final),
            size_bytes=ckpt.dir_size(final), user_metadata=meta, created_at=now,
            expires_at=now + ttl if ttl else None, public=False,
        )
        try:
            self.store.save_checkpoint(row)  # the commit point
        except BaseException:
            self._drop_uncommitted(tpath, final)
            raise
        failpoints.hit("checkpoint.after_commit")
        if existing is not None and existing.directory != row.directory:
            ckpt.remove_checkpoint_dir(self.data_dir, existing.directory)
        log.info("checkpoint %s saved (%s, %.1f MB)", tpath.uri, kind, row.size_bytes / 1e6)
        return tpath.uri

    @staticmethod
    def _write_checkpoint(run: LiveRun, engine: TrainingEngine, kind: str, name: str, tmp: Path) -> None:
        if kind == "training":
            engine.save_state(tmp, optimizer=True)
        elif kind == "external":
            external.write_export(engine, run.spec, name, tmp)
        else:
            engine.export_hf(tmp)

    def _drop_uncommitted(self, tpath: ckpt.TinkerPath, final: Path) -> None:
        """The row write failed: remove `final` unless the commit happened after all (a lost
        answer); when even that cannot be read, leave it to the start-up sweep."""
        try:
            row = self.store.get(CheckpointRow, tpath.uri)
        except Exception:  # noqa: BLE001 - the original error is what the caller sees
            return
        if row is None or row.directory != str(final):
            ckpt.remove_dir(final)

    def load_checkpoint(self, run: LiveRun, path: str, optimizer: bool) -> types.LoadWeightsResponse:
        engine = run.require_engine()
        tpath, crow = self._checkpoint(run.owner, path, "training")
        engine.load_state(crow.directory, optimizer=optimizer)
        return types.LoadWeightsResponse(path=tpath.uri, model_id=run.run_id)

    # ------------------------------------------------------------------ info, unload
    def get_info(self, owner: str, model_id: str) -> types.GetInfoResponse:
        row = self.store.get(RunRow, model_id)
        if row is None or row.owner != owner:
            raise NotFoundError(f"unknown model_id {model_id!r}")
        try:
            base: BaseModel | None = self.registry.resolve(row.base_model)
        except UserError:
            base = None
        rank = (row.lora_config or {}).get("rank") if row.is_lora else None
        return types.GetInfoResponse(
            model_id=model_id,
            model_data=types.ModelData(
                arch=model_arch(base.directory) if base else None, model_name=row.base_model,
                tokenizer_id=str(base.directory) if base else None,
            ),
            is_lora=row.is_lora, lora_rank=rank, model_name=row.base_model,
        )

    def unload_session(self, session_id: str) -> None:
        """The session ended: its runs take no new requests, finish what is queued, then
        release their engines (adapters are deleted from the shared model)."""
        with self._lock:
            runs = [r for r in self._runs.values() if r.session_id == session_id]
            for r in runs:
                del self._runs[r.run_id]
        for run in runs:
            self.store.update(RunRow, run.run_id, status="unloaded")
            run.seq.drain(lambda run=run: self._release(run))

    def _release(self, run: LiveRun) -> None:
        """On the run's lane: free the engine; a lane no live run uses any more is closed."""
        if run.engine is not None:
            self.factory.release(run.spec, run.engine)
            run.engine = None
        key = self.factory.lane_key(run.spec)
        with self._lock:
            # The service may have closed meanwhile (close() forgets every lane): nothing to do.
            users = self._lane_users.get(key, 0) - 1
            if users > 0:
                self._lane_users[key] = users
                return
            self._lane_users.pop(key, None)
            lane = self._lanes.pop(key, None)
        if lane is not None:
            lane.close(wait=False)  # lets this task finish; the thread then exits

    def queue_depths(self) -> dict[str, int]:
        """run_id -> requests waiting in its sequencer, for every live run (metrics)."""
        with self._lock:
            runs = list(self._runs.values())
        return {run.run_id: run.seq.queued for run in runs}

    def close(self) -> None:
        with self._lock:
            runs, self._runs = list(self._runs.values()), {}
            lanes, self._lanes, self._lane_users = list(self._lanes.values()), {}, {}
        for run in runs:
            run.seq.close("the server is shutting down")
        for lane in lanes:
            lane.close(wait=False)
        self.factory.close()

    def checkpoints_of_run(self, run_id: str) -> list[CheckpointRow]:
        return self.store.checkpoints_of_run(run_id, time.time())
