"""Training runs: creation (fresh or from a checkpoint, one path), ordered ops, saves.

A live run is a `LiveRun`: its spec, its lane (shared by every LoRA run of one base
model; `ember.service.lanes`), its `RunSequencer` and, once created on the lane, its
engine. Every op is executed on the lane by `execute`, which turns the outcome into a
finished future: `UserError` (bad input, raised where it is validated, with the engine's
message) and NonFiniteGradientError are `user` failures; anything else, a ValueError
included, is a `server` failure, logged with its traceback. A failing op never stops the lane or the run. What a run is created
with is checked in `ember.service.run_validation`; checkpoints are `CheckpointStore`'s.
Restarts (README "Restarts"): `shutdown` saves every live run as its automatic checkpoint,
`autosave` does so every `autosave_every_steps` steps, and `live` restores a run that is
not loaded from it (`_restore`; its engine is loaded on the lane before its first op).
"""

from __future__ import annotations

import json
import logging
import pickle
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinker import types

from ember import failpoints
from ember.engine.base import NonFiniteGradientError, TrainingEngine
from ember.service import external
from ember.service.api import NotFoundError, RequestType, Submission, UserError
from ember.service.checkpoint_store import AUTOSAVE_NAME, CheckpointStore
from ember.service.clock import SYSTEM_CLOCK, Clock
from ember.service.engines import EngineFactory, RunSpec
from ember.service.faults import public_message
from ember.service.futures import FutureTable, Server, User
from ember.service.lanes import LanePool
from ember.service.limits import Limits
from ember.service.requests import CreateModelRequest, LoadWeightsRequest
from ember.service.model_registry import BaseModel, ModelRegistry
from ember.service.quotas import check_runs
from ember.service.run_validation import (
    is_seq_id, model_arch, resumed_optimizer, saved_head, validate_head, validate_lora, validate_model_seq_id,
    validate_optimizer,
)
from ember.service.sequencer import Lane, RunSequencer
from ember.service.sessions import session_of
from ember.service.store import CheckpointRow, RunRow, SessionRow, Store

log = logging.getLogger(__name__)

RESTARTED = (
    "training run {run} is not loaded: the server restarted (or its session ended) since it was created. "
    "Recreate it from its last checkpoint with create_training_client_from_state[_with_optimizer]"
)
# What a run is saved as when its session expires (no heartbeat, or idle) before it unloads.
SESSION_END_CHECKPOINT = "session-end"
SAVED_AT_SESSION_END = "; it was saved when its session ended: {path} (its state and optimizer)"
# Beside an automatic save's state: where the run was, and the forward_backwards whose
# gradient no optim_step applied yet (the state holds no gradient: they run again at reload).
RESUME_FILE = "ember-resume.json"
UNAPPLIED_FILE = "ember-unapplied.pickle"
SHUTDOWN_NOT_RUN = ("the server shut down before this request ran (it was not executed; its run was saved "
                    "and comes back on its next request): submit it again")
SHUTTING_DOWN = "the server is shutting down: this request was not accepted; submit it again once it is back"
# The first op after a run came back from an automatic save made while it ran (the server
# was killed): its result's metrics carry the step it resumed from (steps after it are lost).
RESUMED_METRIC = "ember_resumed_from_step:max"


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
    steps: int = 0  # optim_steps taken (the metric history's step; kept across restarts)
    restore_from: CheckpointRow | None = None  # automatic save to load on the lane before its first op
    resumed_from: int | None = None  # step an unclean restore resumed from, told by its first op
    resync: bool = False  # its first request sets its next seq_id (an unclean restore)
    seq_running: int = -1
    # Names the run's current weights; new at every change (optim_step, load_state, a fresh
    # engine), kept in its automatic save: a sampling session snapshot of the same token
    # holds these very weights (`SamplerManager.persist_snapshots`, at a clean stop).
    weights_token: str = field(default_factory=lambda: uuid.uuid4().hex)
    # (datums, loss_fn, loss_fn_config) of each forward_backward since the last optim_step
    unapplied: list[tuple[list, str, dict | None]] = field(default_factory=list)  # seq_id of the op executing (an automatic save records the next one)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def accumulated(self, datums: list, loss_fn: str, loss_fn_config: dict | None) -> None:
        """A forward_backward added to the gradient (an automatic save keeps it to run again)."""
        self.unapplied.append((list(datums), loss_fn, loss_fn_config))

    def require_engine(self) -> TrainingEngine:
        if self.engine is None:
            raise UserError(f"training run {self.run_id} could not be created: {self.error or 'not ready'}")
        return self.engine


def classify(exc: BaseException) -> tuple[str, types.RequestErrorCategory]:
    """`user` for what validation refused (`UserError`: the engine names datum and field) and
    for a non-finite gradient (the data's, not ours); anything else is `server`, even a
    ValueError: one from torch or numpy is a bug of ours, not bad input."""
    if isinstance(exc, (UserError, NonFiniteGradientError)):
        return str(exc), User
    return public_message(exc), Server


@dataclass
class CreatePlan:
    """What a create call resolved before the run exists: its spec and optimizer, where it
    came from, and what its first op (seq_id 0) does once the engine is built."""

    spec: RunSpec
    optimizer: dict
    user_metadata: Any
    finish: Callable[[TrainingEngine], Any]  # engine -> the create call's response
    created_from: str | None = None


class RunManager:
    """Creates runs, queues their ops in seq_id order and executes them on lanes."""

    def __init__(
        self, store: Store, futures: FutureTable, registry: ModelRegistry, factory: EngineFactory,
        checkpoints: CheckpointStore, gap_timeout_s: float, limits: Limits | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.store, self.futures, self.registry, self.factory = store, futures, registry, factory
        self.checkpoints = checkpoints
        self._clock = clock  # creation and last-request times (ember.service.clock)
        self.gap_timeout_s = gap_timeout_s
        self.limits = limits or Limits()
        self._runs: dict[str, LiveRun] = {}
        self._lanes = LanePool()
        self._lock = threading.Lock()
        self.autosave_every_steps = 0  # RunsConfig.autosave_every_steps (set by the Service)
        self._shutting_down = False
        # Colocation (SamplerConfig.colocate): called on the run's lane around every op, so
        # the samplers sleep and the engine is on its device while it trains, offloaded after.
        self.before_op: Callable[[LiveRun], None] | None = None
        self.after_op: Callable[[LiveRun], None] | None = None
        # Called on the run's lane right after each automatic save, a clean stop's final one
        # and every autosave_every_steps (the Service persists the run's snapshot sampling
        # sessions with it: `SamplerManager.persist_snapshots`).
        self.after_autosave: Callable[[LiveRun], None] | None = None

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

    def live(self, owner: str, model_id: str) -> LiveRun:
        with self._lock:
            run = self._runs.get(model_id)
        if run is not None and run.owner == owner:
            return run
        row = self.store.get(RunRow, model_id)
        if row is None or row.owner != owner:
            raise NotFoundError(f"unknown model_id {model_id!r}")
        if self._shutting_down:
            raise RunNotLoadedError(SHUTTING_DOWN)
        restored = self._restore(row)
        if restored is not None:
            return restored
        saved = self.checkpoints.row(f"tinker://{model_id}/weights/{SESSION_END_CHECKPOINT}")
        hint = SAVED_AT_SESSION_END.format(path=saved.tinker_path) if saved is not None else ""
        raise RunNotLoadedError(RESTARTED.format(run=model_id) + hint)

    def _restore(self, row: RunRow) -> LiveRun | None:
        """`row`'s run back from its automatic save (a restart: README "Restarts"), while its
        session is active; None when there is nothing to restore. Cheap: its engine is built
        and loaded on its lane before its first op (`_reload`)."""
        session = self.store.get(SessionRow, row.session_id)
        if row.status == "failed" or session is None or session.status != "active":
            return None
        saved = self.checkpoints.row(f"tinker://{row.id}/weights/{AUTOSAVE_NAME}")
        resume = read_resume(self.checkpoints.read_extra(saved, RESUME_FILE)) if saved is not None else None
        if resume is None:
            return None
        lora = types.LoraConfig(**row.lora_config) if row.is_lora and row.lora_config else None
        spec = RunSpec(row.id, self.registry.resolve(row.base_model), lora,
                       (row.optimizer_config or {}).get("type", "adamw"), saved_head(self.checkpoints.meta(saved), None))
        with self._lock:
            if row.id in self._runs:
                return self._runs[row.id]
            self._check_quota_locked(row.owner)
            lane = self._lanes.acquire(self.factory.lane_key(spec))
            run = LiveRun(row.id, row.owner, row.session_id, spec, lane,
                          RunSequencer(row.id, lane, self.gap_timeout_s, next_seq=resume["next_seq"], owner=row.owner),
                          steps=resume["steps"], restore_from=saved,
                          weights_token=resume["weights"] or uuid.uuid4().hex,
                          resumed_from=None if resume["clean"] else resume["steps"], resync=not resume["clean"])
            self._runs[row.id] = run
        self.store.update(RunRow, row.id, status="active")
        how = "a clean shutdown" if resume["clean"] else "an automatic save (later steps were lost)"
        log.log(logging.INFO if resume["clean"] else logging.WARNING, "run %s comes back at step %d from %s",
                row.id, resume["steps"], how)
        return run

    def _check_quota_locked(self, owner: str) -> None:
        n = sum(1 for r in self._runs.values() if r.owner == owner and r.error is None)
        check_runs(n, self.limits.max_runs_per_key)

    def loaded_runs(self, owner: str) -> int:
        """Runs of `owner` loaded now (created, or being created; not failed)."""
        with self._lock:
            return sum(1 for r in self._runs.values() if r.owner == owner and r.error is None)

    # ------------------------------------------------------------------ creation (one path)
    def create_model(self, owner: str, request: CreateModelRequest) -> Submission:
        lora_config, optimizer_config, user_metadata = request.lora_config, request.optimizer_config, request.user_metadata

        def plan(run_id: str) -> CreatePlan:
            validate_lora(lora_config)
            self.limits.check_lora_rank(lora_config)
            optimizer = validate_optimizer(optimizer_config)
            spec = RunSpec(run_id, self.registry.resolve(request.base_model), lora_config, optimizer["type"],
                           validate_head(user_metadata))
            return CreatePlan(spec, optimizer, user_metadata, lambda _: types.CreateModelResponse(model_id=run_id))

        return self._create(owner, request.session_id, request.model_seq_id, "CreateModel", plan)

    def create_from_checkpoint(self, owner: str, request: LoadWeightsRequest) -> Submission:
        """A new run from a training checkpoint (`request.creates_run`: its session_id + model_seq_id)."""
        path, optimizer, base_model = request.path, bool(request.optimizer), request.base_model
        user_metadata, optimizer_config, access_token = (request.user_metadata, request.optimizer_config,
                                                         request.weights_access_token)

        def plan(run_id: str) -> CreatePlan:
            # the owner's, a published one, or one `access_token` grants
            tpath, crow = self.checkpoints.training_state(owner, path, access_token)
            src = self.store.get(RunRow, crow.run_id)
            lora = types.LoraConfig(**src.lora_config) if src is not None and src.lora_config else None
            base = self.registry.resolve(base_model or (src.base_model if src else ""))
            meta = self.checkpoints.meta(crow)
            opt = resumed_optimizer(meta, optimizer, optimizer_config)
            spec = RunSpec(run_id, base, lora, opt["type"], saved_head(meta, user_metadata))

            def finish(engine: TrainingEngine) -> types.LoadWeightsResponse:
                engine.load_state(crow.directory, optimizer=optimizer)
                return types.LoadWeightsResponse(path=tpath.uri, model_id=run_id)

            return CreatePlan(spec, opt, user_metadata, finish, created_from=tpath.uri)

        return self._create(owner, request.session_id, request.model_seq_id, "LoadWeights", plan)

    def _create(self, owner: str, session_id: str, model_seq_id: Any, rtype: RequestType,
                plan: Callable[[str], CreatePlan]) -> Submission:
        """The one creation path: the future (idempotent on the run id), the checks of
        `plan`, the run registered, then its engine built (and loaded) as its seq_id 0."""
        run_id = f"{session_id}:train:{model_seq_id}"
        sub, created = self.futures.create(owner, rtype, model_id=run_id, dedup_key=f"create:{run_id}",
                                           session=session_of(run_id))
        if not created:
            return sub
        with self.futures.accepting(sub.request_id):
            try:
                validate_model_seq_id(model_seq_id)
                resolved = plan(run_id)
                if self.store.get(RunRow, run_id) is not None:
                    raise UserError(f"model {run_id} already exists (model_seq_id {model_seq_id} reused in this session)")
                run = self._register(owner, session_id, model_seq_id, resolved)
            except UserError as exc:
                self.futures.fail(sub.request_id, str(exc), User)
                return sub

            def op() -> Any:
                self._build_engine(run)
                return resolved.finish(run.engine)

            run.seq.offer(0, lambda: self.execute(sub.request_id, op),
                          lambda r: self.futures.fail(sub.request_id, r, Server))
        return sub

    def _register(self, owner: str, session_id: str, model_seq_id: int, plan: CreatePlan) -> LiveRun:
        """The run's live state (counted against `limits.max_runs_per_key`), then its row."""
        spec = plan.spec
        with self._lock:
            self._check_quota_locked(owner)
            lane = self._lanes.acquire(self.factory.lane_key(spec))
            run = LiveRun(spec.run_id, owner, session_id, spec, lane,
                          RunSequencer(spec.run_id, lane, self.gap_timeout_s, next_seq=0, owner=owner))
            self._runs[spec.run_id] = run
        now = self._clock()
        try:
            self.store.add(RunRow(
                id=spec.run_id, owner=owner, session_id=session_id, model_seq_id=model_seq_id,
                base_model=spec.base.name, is_lora=spec.is_lora,
                lora_config=spec.lora_config.model_dump() if spec.lora_config else None,
                optimizer_config=plan.optimizer, user_metadata=dict(plan.user_metadata or {}) or None,
                created_from=plan.created_from, status="active", created_at=now, last_request_time=now,
            ))
        except BaseException:
            with self._lock:
                self._runs.pop(spec.run_id, None)
            self._lanes.release(self.factory.lane_key(spec))
            raise
        return run

    def _build_engine(self, run: LiveRun) -> None:
        try:
            failpoints.hit("run.create_engine")
            run.engine = self.factory.create(run.spec)
        except BaseException as exc:
            run.error = classify(exc)[0]
            self.store.update(RunRow, run.run_id, status="failed")
            raise
        spec = run.spec
        log.info("run %s created for %s: base model %s, %s, %s head", run.run_id, run.owner, spec.base.name,
                 f"LoRA rank {spec.lora_config.rank}" if spec.is_lora else "full fine-tuning", spec.head)

    # ------------------------------------------------------------------ ordered ops
    def submit_op(self, owner: str, model_id: str, seq_id: Any, rtype: RequestType,
                  fn: Callable[[LiveRun], Any]) -> Submission:
        """Queue `fn(run)` as request `seq_id` of `model_id` (idempotent on (model_id, seq_id))."""
        if not is_seq_id(seq_id):
            return self.reject(owner, rtype, f"seq_id must be an integer >= 0, got {seq_id!r}", model_id=model_id)
        sub, created = self.futures.create(owner, rtype, model_id=model_id, dedup_key=f"op:{model_id}:{seq_id}",
                                           session=session_of(model_id))
        if created:
            with self.futures.accepting(sub.request_id):
                self._queue_op(sub.request_id, owner, model_id, seq_id, fn)
        return sub

    def refuse_op(self, owner: str, model_id: str, seq_id: Any, rtype: RequestType, error: UserError) -> Submission:
        """An ordered request refused before it was queued (its data or options are wrong):
        failed at once with `error` (user), and its seq_id's turn in the caller's run taken
        by nothing, so that the run's next request does not wait out the gap timeout for it.
        Each refusal is a future of its own (it names what was wrong with that request)."""
        sub = self.reject(owner, rtype, str(error), model_id=model_id)
        if is_seq_id(seq_id):
            self._skip_turn(owner, model_id, seq_id)
        return sub

    def _skip_turn(self, owner: str, model_id: str, seq_id: int) -> None:
        """Give `seq_id` of the caller's own live run an empty op (only within max_seq_ahead;
        a turn already passed or taken is left as it is)."""
        try:
            run = self._run_for_turn(owner, model_id, seq_id)
        except (NotFoundError, UserError, RunNotLoadedError):
            return  # no run of the caller's to keep in order, or a turn too far ahead to hold
        run.seq.offer(seq_id, lambda: None, lambda _reason: None)

    def _queue_op(self, rid: str, owner: str, model_id: str, seq_id: int, fn: Callable[[LiveRun], Any]) -> None:
        try:
            run = self._run_for_turn(owner, model_id, seq_id)
        except (NotFoundError, UserError) as exc:
            self.futures.fail(rid, str(exc), User)
            return
        except RunNotLoadedError as exc:
            self.futures.fail(rid, str(exc), Server)
            return
        self._touch(run)
        run.seq.offer(seq_id, lambda: self.execute(rid, lambda: self._run_op(run, fn, seq_id)),
                      lambda r: self.futures.fail(rid, r, Server))

    def _run_for_turn(self, owner: str, model_id: str, seq_id: int) -> LiveRun:
        """The caller's live run, given that `seq_id` is within max_seq_ahead of its next turn:
        checked before the sequencer holds anything (a far-ahead seq_id would wait, then skip
        the gap)."""
        run = self.live(owner, model_id)
        if run.resync:  # back from a save made while it ran: its client numbers on from here
            run.resync = False
            run.seq.start_at(seq_id)
        self.limits.check_seq_ahead(seq_id, run.seq.next_seq, model_id)
        return run

    def _run_op(self, run: LiveRun, fn: Callable[[LiveRun], Any], seq_id: int = -1) -> Any:
        failpoints.hit("run.op")
        if run.restore_from is not None:
            self._reload(run)
        if self.before_op is not None:
            self.before_op(run)
        run.seq_running = seq_id
        try:
            result = fn(run)
        finally:
            if self.after_op is not None:
                self.after_op(run)
        if run.resumed_from is not None and isinstance(getattr(result, "metrics", None), dict):
            result.metrics[RESUMED_METRIC] = float(run.resumed_from)  # the client's next call says so
            run.resumed_from = None
        return result

    def _reload(self, run: LiveRun) -> None:
        """On the run's lane, before its first op after a restart: its engine, loaded from its
        automatic save (weights, optimizer, engine step and RNG)."""
        saved, run.restore_from = run.restore_from, None
        self._build_engine(run)
        try:
            run.engine.load_state(saved.directory, optimizer=True)
            unapplied = read_unapplied(self.checkpoints.extra_bytes(saved, UNAPPLIED_FILE))
            for datums, loss_fn, cfg in unapplied:  # the gradient not applied yet, rebuilt
                run.engine.forward_backward(datums, loss_fn, cfg)
                run.accumulated(datums, loss_fn, cfg)
        except BaseException as exc:
            run.error = classify(exc)[0]
            self.factory.release(run.spec, run.engine)
            run.engine = None
            self.store.update(RunRow, run.run_id, status="failed")
            raise

    def step_taken(self, run: LiveRun) -> None:
        """After an optim_step (on the lane): count it; every `autosave_every_steps`, the
        automatic save (a failed one is logged, never fails the step)."""
        run.steps += 1
        run.unapplied.clear()
        run.weights_token = uuid.uuid4().hex
        every = self.autosave_every_steps
        if every and run.steps % every == 0:
            try:
                self.autosave(run, clean=False, next_seq=run.seq_running + 1)
                if self.after_autosave is not None:
                    self.after_autosave(run)
            except Exception as exc:  # noqa: BLE001 - the step itself succeeded
                log.warning("run %s: automatic save at step %d failed: %s", run.run_id, run.steps,
                            public_message(exc))

    def autosave(self, run: LiveRun, clean: bool, next_seq: int) -> CheckpointRow:
        """The run's automatic save (on its lane): training state with the optimizer, plus
        where it was (`RESUME_FILE`: step, next seq_id, and whether nothing ran after it)."""
        engine = run.require_engine()
        resume = {"steps": run.steps, "next_seq": next_seq, "clean": clean, "weights": run.weights_token}
        unapplied = list(run.unapplied)

        def write(tmp: Path) -> None:
            engine.save_state(tmp, optimizer=True)
            (tmp / RESUME_FILE).write_text(json.dumps(resume))
            # pickled: the SDK's Datum has no other serialization; the file is the server's own
            # (the data directory is never readable or writable by path through any request)
            (tmp / UNAPPLIED_FILE).write_bytes(pickle.dumps(unapplied))

        return self.checkpoints.save(run.run_id, run.owner, "training", AUTOSAVE_NAME, write, overwrite=True)

    def _touch(self, run: LiveRun) -> None:
        """Record the run's last request time (at most once a second: it is only for listings)."""
        now = self._clock()
        if now - run.touched >= 1.0:
            run.touched = now
            try:
                self.store.update(RunRow, run.run_id, last_request_time=now)
            except Exception as exc:  # noqa: BLE001 - a listing's timestamp must not fail the request
                log.warning("run %s: last_request_time not recorded (%s)", run.run_id, public_message(exc))

    # ------------------------------------------------------------------ checkpoint ops (run on the lane)
    def save_checkpoint(self, run: LiveRun, name: Any, kind: str, overwrite: bool, ttl_seconds,
                        user_metadata) -> CheckpointRow:
        """Save the run's current state (`kind`: training | sampler | external) as checkpoint
        `name` through the `CheckpointStore`; its committed row."""
        engine = run.require_engine()
        if name == AUTOSAVE_NAME:
            raise UserError(f"checkpoint name {AUTOSAVE_NAME!r} is the server's automatic save; choose another")

        def write(tmp: Path) -> None:
            if kind == "training":
                engine.save_state(tmp, optimizer=True)
            elif kind == "external":
                external.write_export(engine, run.spec, name, tmp)
            else:
                engine.export_hf(tmp)

        return self.checkpoints.save(run.run_id, run.owner, kind, name, write, overwrite=overwrite,
                                     ttl_seconds=ttl_seconds, user_metadata=user_metadata)

    def load_checkpoint(self, run: LiveRun, path: str, optimizer: bool,
                        access_token: str | None = None) -> types.LoadWeightsResponse:
        engine = run.require_engine()
        tpath, crow = self.checkpoints.training_state(run.owner, path, access_token)
        engine.load_state(crow.directory, optimizer=optimizer)
        run.unapplied.clear()  # load_state dropped the gradient
        run.weights_token = uuid.uuid4().hex
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

    def unload_session(self, session_id: str, save_as: str | None = None) -> None:
        """The session ended: its runs take no new requests, finish what is queued, are
        saved as the training-state checkpoint `save_as` if given (the session expired:
        its client may come back), then release their engines (adapters are deleted from
        the shared model)."""
        with self._lock:
            runs = [r for r in self._runs.values() if r.session_id == session_id]
            for r in runs:
                del self._runs[r.run_id]
        for run in runs:
            self.store.update(RunRow, run.run_id, status="unloaded")
            run.seq.drain(lambda run=run: self._save_then_release(run, save_as))

    def _save_then_release(self, run: LiveRun, save_as: str | None) -> None:
        if save_as is not None and run.engine is not None:
            try:
                row = self.save_checkpoint(run, save_as, "training", overwrite=True, ttl_seconds=None,
                                           user_metadata=None)
                log.info("run %s saved as %s before unloading (its session ended)", run.run_id, row.tinker_path)
            except Exception as exc:  # noqa: BLE001 - the run is unloaded either way; say why it was not saved
                log.warning("run %s could not be saved before unloading: %s", run.run_id, public_message(exc))
        self._release(run)

    def _release(self, run: LiveRun) -> None:
        """On the run's lane: free the engine; a lane no live run uses any more is closed."""
        if run.engine is not None:
            self.factory.release(run.spec, run.engine)
            run.engine = None
        self._lanes.release(self.factory.lane_key(run.spec))

    def live_runs_of(self, owner: str) -> dict[str, LiveRun]:
        """run_id -> live run, for `owner`'s runs loaded now (the console)."""
        with self._lock:
            return {r.run_id: r for r in self._runs.values() if r.owner == owner}

    def queue_depths(self) -> dict[str, int]:
        """run_id -> requests waiting in its sequencer, for every live run (metrics)."""
        with self._lock:
            runs = list(self._runs.values())
        return {run.run_id: run.seq.queued for run in runs}

    def lane_depths(self) -> dict[str, tuple[int, int]]:
        """"lane <n> (<base models>)" -> (live runs on it, requests waiting in their
        sequencers), for every lane in use (the status line)."""
        with self._lock:
            runs = list(self._runs.values())
        lanes: dict[str, list[LiveRun]] = {}
        for run in runs:
            lanes.setdefault(run.lane.name, []).append(run)
        return {f"lane {name} ({', '.join(sorted({r.spec.base.name for r in on}))})":
                (len(on), sum(r.seq.queued for r in on)) for name, on in sorted(lanes.items())}

    def all_live_runs(self) -> dict[str, LiveRun]:
        """run_id -> live run, every owner's (the operator's view)."""
        with self._lock:
            return dict(self._runs)

    def unload_run(self, run_id: str, save_as: str | None = None) -> threading.Event | None:
        """The operator unloads one run, as `unload_session` does a session's (saved as
        `save_as` first, so that its owner can resume), after the requests queued before it.
        The event is set once it is saved and released; None if it was not loaded."""
        with self._lock:
            run = self._runs.pop(run_id, None)
        if run is None:
            return None
        self.store.update(RunRow, run.run_id, status="unloaded")
        done = threading.Event()

        def save_then_release() -> None:
            try:
                self._save_then_release(run, save_as)
            finally:
                done.set()

        run.seq.drain(save_then_release)
        return done

    def shutdown(self, drain_s: float) -> int:
        """A clean stop, before `close`: no new request is taken; what is queued runs for up
        to `drain_s` (what is left then fails, category server: `SHUTDOWN_NOT_RUN`); then
        every live run is saved (`autosave`), waited for up to `drain_s` more. How many were."""
        with self._lock:
            self._shutting_down = True
            runs = list(self._runs.values())
        done = {run.run_id: threading.Event() for run in runs}
        for run in runs:
            run.seq.drain(lambda run=run: self._final_save(run, done[run.run_id], clean=True))
        late = _wait_all(runs, done, drain_s)
        for run in late:  # its queue did not empty in time: save what ran, after the op running now
            run.seq.close(SHUTDOWN_NOT_RUN)
            run.lane.submit(lambda run=run: self._final_save(run, done[run.run_id], clean=False), run.owner)
        unsaved = _wait_all(late, done, drain_s)
        for run in unsaved:
            log.warning("run %s was not saved at shutdown: its last op did not end within runs.shutdown_drain_s=%s",
                        run.run_id, drain_s)
        return len(runs) - len(unsaved)

    def _final_save(self, run: LiveRun, done: threading.Event, clean: bool) -> None:
        if done.is_set() or run.engine is None:
            done.set()
            return
        try:
            row = self.autosave(run, clean=clean, next_seq=run.seq.next_seq)
            log.debug("run %s saved at step %d for the restart: %s", run.run_id, run.steps, row.tinker_path)
            if self.after_autosave is not None:
                self.after_autosave(run)
        except Exception as exc:  # noqa: BLE001 - the others are still saved; say why this one was not
            log.warning("run %s could not be saved at shutdown: %s", run.run_id, public_message(exc))
        finally:
            done.set()

    def close(self) -> None:
        with self._lock:
            runs, self._runs = list(self._runs.values()), {}
        for run in runs:
            run.seq.close("the server is shutting down")
        self._lanes.close()
        self.factory.close()


def _wait_all(runs: list[LiveRun], done: dict[str, threading.Event], timeout_s: float) -> list[LiveRun]:
    """Wait up to `timeout_s` in all for each run's event; the runs whose event is not set."""
    deadline = time.monotonic() + timeout_s
    for run in runs:
        done[run.run_id].wait(max(0.0, deadline - time.monotonic()))
    return [run for run in runs if not done[run.run_id].is_set()]


def read_resume(text: str | None) -> dict[str, Any] | None:
    """An automatic save's `RESUME_FILE` from its text (steps, next_seq, clean, weights: the
    run's `weights_token`, None in a save older than it), or None if absent or unreadable."""
    if text is None:
        return None
    try:
        resume = json.loads(text)
        weights = resume.get("weights")
        return {"steps": int(resume["steps"]), "next_seq": int(resume["next_seq"]), "clean": bool(resume["clean"]),
                "weights": weights if isinstance(weights, str) else None}
    except (ValueError, KeyError, TypeError):
        return None


def read_unapplied(data: bytes | None) -> list[tuple[list, str, dict | None]]:
    """An automatic save's `UNAPPLIED_FILE` from its bytes: the forward_backwards to run again
    (none if absent)."""
    return pickle.loads(data) if data is not None else []  # noqa: S301 - written by this server
