"""`Service`: the `ServiceAPI` implementation, composed of small managers.

    SessionManager  (sessions.py)  sessions, heartbeats, expiry
    RunManager      (runs.py)      training runs, ordered ops on lanes
    CheckpointStore (checkpoint_store.py) checkpoints: save, access, publish, TTL, delete, links, sweeps
    SamplerManager  (samplers.py)  sampling sessions (immutable weight versions), samples
    FutureTable     (futures.py)   futures, persisted
    rest.py                        REST listings
    Store           (store.py)     SQLAlchemy persistence

This class validates arguments, checks visibility (owner) and delegates; the training
and sampling work happens in the managers' lanes and samplers.

The managers are attributes (`store`, `futures`, `runs`, `samplers`, `sessions`,
`checkpoints`, `registry`, `records`, `metric_history`, `image_admission`), read-only by contract: the
server's routes, console and metrics call `ServiceAPI` methods only (its views:
`owner_state`, `run_facts`, `session_facts`, `gauges`, the listeners). What a test must
see inside has a read-only accessor here ("inspection" below) or a documented read
method on its manager (`CheckpointStore.row`).
Tests never drive `store`, `runs` or `futures` (tests/test_tests.py checks): a state no
request can make comes from a fail point (`ember.failpoints`: `run.op` held with `hold`
keeps an op running), from the database file as another process writes it, or from
`wrap_ops` (hooks around every op, the seam colocation uses).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tinker import types

from ember.engine.optimizers import OPTIMIZERS, params_name
from ember.service import external, rest
from ember.service.fidelity import logprob_gap_metrics
from ember.service.checkpoint_store import CheckpointStore, check_ttl
from ember.service.clock import SYSTEM_CLOCK, Clock
from ember.service.api import (
    BusyError, ExternalWeightsLinks, FutureState, NotFoundError, OwnerOverview, RunFacts, ServerState, ServiceAPI,
    ServiceGauges, SessionFacts, Submission, UserError,
)
from ember.service.config import ServiceConfig, WorkersConfig
from ember.service.datadir import DataDirLock
from ember.service.engines import EngineFactory, LocalEngineFactory, engine_factory_for
from ember.service.model_registry import ModelRegistry
from ember.service.futures import FutureTable
from ember.service.image_admission import ImageAdmission
from ember.service.images import check_request_images, count_images, vision_spec_of
from ember.service.metric_history import MetricHistory, target_tokens
from ember.service.quotas import check_sampling_sessions
from ember.service.requests import (
    CreateModelRequest, CreateSessionRequest, ForwardBackwardRequest, LoadWeightsRequest, OptimStepRequest,
    SampleRequest, SaveWeightsForSamplerRequest, SaveWeightsRequest, SubmitRequest,
)
from ember.service.run_validation import check_samplable
from ember.service.runs import SESSION_END_CHECKPOINT, LiveRun, RunManager, RunNotLoadedError
from ember.service.samplers import LocalSamplerFactory, SamplerFactory, SamplerManager, max_positions
from ember.service.sessions import SessionManager, session_of
from ember.service.routing_records import OPTION, replay_option, with_routes
from ember.service.stability import StabilityRecords
from ember.service.store import FutureRow, SamplerRow, SessionRow, Store

log = logging.getLogger(__name__)

RESTART_MESSAGE = (
    "the server restarted while this request was in flight; its outcome is unknown. "
    "Resubmit it (recreate the training run from its last checkpoint if needed)"
)


@dataclasses.dataclass(frozen=True)
class ServiceDebugState:
    """A snapshot of a Service's state (`Service.debug_state`); its values are the live objects."""

    engine_factory: EngineFactory  # the one this service's runs are built by
    runs: dict[str, LiveRun]  # model_id -> loaded run (spec, lane, engine)
    samplers: dict[str, Any]  # `SamplerManager.debug_state`
    unsaved_futures: int  # finished futures whose final state is in memory only (database writes failing)
    futures: dict[str, FutureRow | None]  # request id -> its database row as it is now (None: absent)


class Service(ServiceAPI):
    """The multi-tenant service (see `ember.service.api` for the contract)."""

    def __init__(
        self,
        config: ServiceConfig,
        *,
        engine_factory: EngineFactory | None = None,
        sampler_factory: SamplerFactory | None = None,
        clock: Clock | None = None,
    ) -> None:
        """`clock` (default `time.time`: `ember.service.clock`) is the one clock of every manager
        (sessions, checkpoints' TTLs, futures' times and deadlines, stability records, runs,
        samplers, metric history); tests pass a manual one to expire things without sleeping."""
        self.config = config
        self._clock = clock or SYSTEM_CLOCK
        config.data_dir.mkdir(parents=True, exist_ok=True)
        self._data_lock = DataDirLock(config.data_dir)
        self._data_lock.acquire()  # before the database: a second process must not fail our futures
        try:
            self._start(config, engine_factory, sampler_factory)
        except BaseException:
            self._data_lock.release()
            raise

    def _start(self, config: ServiceConfig, engine_factory: EngineFactory | None,
               sampler_factory: SamplerFactory | None) -> None:
        durability = config.durability
        self.store = Store(config.resolved_database_url, lock_timeout_s=durability.db_lock_timeout_s)
        failed = self.store.fail_pending_futures(RESTART_MESSAGE, self._clock())
        unloaded = self.store.unload_active_runs()
        # Runs left loaded by an earlier process are routine (every process ends so, in process
        # too); requests cut off in flight are not (it did not end cleanly): only they warn.
        if failed:
            log.warning("%d request(s) of an earlier process on this data directory were in flight when it ended: "
                        "failed (their clients are told so)", failed)
        if unloaded:
            log.debug("%d training run(s) of an earlier process on this data directory marked unloaded", unloaded)
        clock = self._clock
        self.checkpoints = CheckpointStore(self.store, config.data_dir, config.checkpoints,
                                           quota_bytes=config.limits.max_checkpoint_bytes_per_key, clock=clock)
        self.checkpoints.sweep_interrupted()  # before any run or sampler exists
        self.registry = ModelRegistry(config.models, roots=config.model_roots, private=[config.data_dir])
        self.futures = FutureTable(self.store, finish_retry_s=durability.finish_retry_s,
                                   check_result_size=config.limits.check_result_size, clock=clock)
        self.runs = RunManager(
            self.store, self.futures, self.registry, engine_factory or LocalEngineFactory(config.engine),
            self.checkpoints, config.seq_gap_timeout_s, config.limits, clock=clock,
        )
        self.runs.autosave_every_steps = config.runs.autosave_every_steps
        self.records = StabilityRecords(config.stability, clock=clock)
        self.metric_history = MetricHistory(self.store, config.metric_history_rows, clock=clock)
        self._sampler_runs: dict[str, str | None] = {}  # sampling session -> the run it samples (`_count_samples`)
        self.samplers = SamplerManager(
            self.store, self.futures, self.registry,
            sampler_factory or LocalSamplerFactory(config.sampler, config.engine, config.data_dir / "scratch"),
            config.max_samplers_per_session, records=self.records, limits=config.limits, clock=clock,
            checkpoints=self.checkpoints,
        )
        self.samplers.check_registered()
        self.runs.after_autosave = self._persist_snapshots
        if config.sampler is not None and getattr(config.sampler, "colocate", False):
            self._colocate()
        self.sessions = SessionManager(self.store, config.sessions.heartbeat_timeout_s, self._on_session_expired,
                                       idle_ttl_s=config.sessions.idle_ttl_s,
                                       max_per_key=config.limits.max_sessions_per_key, clock=clock)
        self.futures.on_session_activity = self.sessions.touch
        self.image_admission = ImageAdmission(config.limits)
        self._closed = threading.Event()
        self._housekeeper = threading.Thread(target=self._housekeeping_loop, name="ember-housekeeping", daemon=True)
        self._housekeeper.start()

    def _colocate(self) -> None:
        """Trainer and sampler share a GPU: samplers sleep while a run's op executes (on the
        run's lane), the engine is onloaded for it and offloaded after, so the sampler has
        the memory when it wakes for the next sample. Costs a host<->GPU copy of the
        trainer's state per op; for CUDA (the CPU has nothing to share)."""
        def before(run) -> None:
            self.samplers.sleep_all()
            if run.engine is not None:
                run.engine.onload()

        def after(run) -> None:
            if run.engine is not None:
                run.engine.offload()

        self.wrap_ops(before, after)

    def wrap_ops(self, before: Callable[[LiveRun], None] | None, after: Callable[[LiveRun], None] | None) -> None:
        """Run `before(run)` and `after(run)` on the run's lane around every training op
        (forward_backward, optim_step, saves, ...); `after` runs even when the op raised.
        Colocation is built on it; one pair at a time (a new call replaces the old)."""
        self.runs.before_op, self.runs.after_op = before, after

    def _housekeeping_loop(self) -> None:
        interval = self.config.housekeeping_interval_s
        for timeout in (self.config.sessions.heartbeat_timeout_s, self.config.sessions.idle_ttl_s):
            if timeout is not None:
                interval = min(interval, max(0.5, timeout / 4))
        sweep_every = self.config.checkpoints.sweep_interval_s
        last = time.monotonic()
        while not self._closed.wait(min(interval, sweep_every)):
            try:
                if time.monotonic() - last >= interval * 0.99:  # a wait may end a hair early
                    last = time.monotonic()
                    self.housekeeping()  # includes the checkpoint sweep
                else:
                    self.sweep_expired_checkpoints()
            except Exception:  # noqa: BLE001 - housekeeping must survive a DB hiccup
                log.exception("housekeeping failed")

    def housekeeping(self) -> None:
        """Expire silent and idle sessions, end stuck futures, delete old finished futures
        and checkpoints past their TTL."""
        durability = self.config.durability
        ended = self.futures.sweep(durability.future_deadline_s, durability.orphan_grace_s)
        if ended:
            log.warning("housekeeping ended %d stuck future(s)", ended)
        self.sessions.expire(busy=self.futures.pending_sessions())
        self.records.expire()
        now = self._clock()
        if self.config.future_retention_s is not None:
            self.store.prune_futures(now - self.config.future_retention_s)
        self.sweep_expired_checkpoints()

    def _on_session_end(self, session_id: str, save_as: str | None = None) -> None:
        self.runs.unload_session(session_id, save_as=save_as)
        self.samplers.drop_session(session_id)
        self.records.drop_session(session_id)

    def _on_session_expired(self, session_id: str) -> None:
        """The client is gone (no heartbeat) or idle: its runs are saved before they unload,
        so that whoever comes back resumes from where they were."""
        self._on_session_end(session_id, save_as=SESSION_END_CHECKPOINT)

    # ------------------------------------------------------------------ sessions
    def open_session(self, owner, request: CreateSessionRequest) -> types.CreateSessionResponse:
        self.config.limits.check_user_metadata(request.user_metadata)
        return self.sessions.create(owner, request.tags, request.user_metadata, request.project_id,
                                    request.display_name, request.sdk_version)

    def heartbeat(self, owner, session_id) -> None:
        self.sessions.heartbeat(owner, session_id)

    def finish_session(self, owner, session_id, reason="success", detail=None) -> None:
        if self.sessions.finish(owner, session_id, reason, detail):
            self._on_session_end(session_id)

    def expire_sessions(self) -> list[str]:
        return self.sessions.expire(busy=self.futures.pending_sessions())

    def get_session(self, owner, session_id) -> types.GetSessionResponse:
        return self.sessions.get(owner, session_id)

    def list_sessions(self, owner, limit=20, offset=0) -> types.ListSessionsResponse:
        return self.sessions.list(owner, limit, offset)

    # ------------------------------------------------------------------ training runs
    def _session_error(self, owner: str, session_id: str) -> str | None:
        try:
            self.sessions.require_active(owner, session_id)
        except UserError as exc:
            return str(exc)
        return None

    def _metadata_error(self, user_metadata) -> str | None:
        try:
            self.config.limits.check_user_metadata(user_metadata)
        except UserError as exc:
            return str(exc)
        return None

    def submit(self, owner, request: SubmitRequest) -> Submission:
        handlers: dict[type, Callable[[str, Any], Submission]] = {
            CreateModelRequest: self._create_model, LoadWeightsRequest: self._load_weights,
            ForwardBackwardRequest: self._forward_backward, OptimStepRequest: self._optim_step,
            SaveWeightsRequest: self._save_weights, SaveWeightsForSamplerRequest: self._save_weights_for_sampler,
            SampleRequest: self._sample}
        handler = handlers.get(type(request))
        if handler is None:
            raise UserError(f"submit: expected a request of ember.service.requests, got {type(request).__name__}")
        return handler(owner, request)

    def _create_model(self, owner, request: CreateModelRequest) -> Submission:
        err = self._session_error(owner, request.session_id) or self._metadata_error(request.user_metadata)
        if err:
            return self.runs.reject(owner, "CreateModel", err)
        return self.runs.create_model(owner, request)

    def get_info(self, owner, model_id) -> types.GetInfoResponse:
        return self.runs.get_info(owner, model_id)

    def _load_weights(self, owner, request: LoadWeightsRequest) -> Submission:
        try:
            request.check_addressing()
        except UserError as exc:
            return self.runs.reject(owner, "LoadWeights", str(exc), model_id=request.model_id)
        if request.creates_run:
            err = self._session_error(owner, request.session_id) or self._metadata_error(request.user_metadata)
            if err:
                return self.runs.reject(owner, "LoadWeights", err)
            return self.runs.create_from_checkpoint(owner, request)
        return self.runs.submit_op(owner, request.model_id, request.seq_id, "LoadWeights",
                                   lambda run: self.runs.load_checkpoint(run, request.path, bool(request.optimizer),
                                                                         request.weights_access_token))

    def _forward_backward(self, owner, request: ForwardBackwardRequest) -> Submission:
        model_id, seq_id, loss_fn, loss_fn_config = (request.model_id, request.seq_id, request.loss_fn,
                                                      request.loss_fn_config)
        data, forward_only, rtype = list(request.data), request.forward_only, request.request_type
        try:
            cfg, replay = replay_option(loss_fn_config, self.config.stability.routing_replay)
            if replay and loss_fn_config and OPTION in loss_fn_config:
                self._check_replay_sampler()
            self.config.limits.check_datums(data, self._positions(owner, model_id))
            data = self.datums_with_images(data, owner, model_id)
        except UserError as exc:
            return self.runs.refuse_op(owner, model_id, seq_id, rtype, exc)

        def op(run: LiveRun) -> types.ForwardBackwardOutput:
            engine = run.require_engine()
            # resolved on the lane, in seq_id order: a sample finished before this op ran
            batch = self.records.resolve(run.owner, run.session_id, data) if loss_fn == "stable_reinforce" else data
            if replay:  # the routes the sampler recorded (ember.service.routing_records)
                batch = with_routes(self.records, run.owner, run.session_id, data, batch)
            out = engine.forward(batch, loss_fn, cfg) if forward_only else engine.forward_backward(batch, loss_fn, cfg)
            if not forward_only:
                run.accumulated(batch, loss_fn, cfg)  # until optim_step: an automatic save runs it again
            out.metrics.update(logprob_gap_metrics(batch, out.loss_fn_outputs))
            self.metric_history.record(run.run_id, run.steps, "forward" if forward_only else "forward_backward",
                                       out.metrics, tokens=target_tokens(out))
            return out

        return self.runs.submit_op(owner, model_id, seq_id, rtype, op)

    def _check_replay_sampler(self) -> None:
        """Routing replay reads routes only TorchSampler records: asked for explicitly with
        another sampler backend, it is refused rather than silently routing normally."""
        backend = self.config.sampler.backend
        if backend != "torch":
            raise UserError(f"loss_fn_config[{OPTION!r}]: routing replay replays the routes TorchSampler records; "
                            f"this server samples with the {backend!r} backend, which records none")

    def _check_images(self, inputs, owner: str, model_dir: str | None = None):
        """`check_request_images` with this service's limits, image roots, data directory
        and decoding budget (`image_admission`), and (given the model's directory) the
        model's image token counts. Out of memory while checking is `BusyError` (retry)."""
        spec = vision_spec_of(str(model_dir)) if model_dir is not None else None
        try:
            return check_request_images(inputs, self.config.limits, self.config.image_roots, [self.config.data_dir],
                                        spec, owner=owner, admission=self.image_admission)
        except MemoryError:
            pass  # raised below, once the frames that held the memory are gone
        raise BusyError("the server ran out of memory checking this request's images; retry later")

    def datums_with_images(self, data: list, owner: str | None = None, model_id: str | None = None) -> list:
        """The datums with their images checked and pointers read (`service/images.py`);
        given the run, each image's token count against its base model's too. What
        `forward_backward` does before queueing; public so that a test sees what a pointer
        chunk resolves to."""
        if not any(count_images(getattr(d, "model_input", None)) for d in data):
            return data
        model_dir = self._run_dir(owner, model_id) if model_id is not None else None
        inputs = self._check_images([(f"datum {i}: model_input", getattr(d, "model_input", None))
                                     for i, d in enumerate(data)], owner or "local", model_dir)
        return [d if d.model_input is mi else
                types.Datum(model_input=mi, loss_fn_inputs=d.loss_fn_inputs, model_input_spans=d.model_input_spans,
                            loss_fn_input_spans=d.loss_fn_input_spans)
                for d, mi in zip(data, inputs)]

    def _run_dir(self, owner: str, model_id: str) -> str | None:
        """The directory of the run's base model (None for a run that is not live)."""
        try:
            return str(self.runs.live(owner, model_id).spec.base.directory)
        except (NotFoundError, RunNotLoadedError):
            return None

    def _sampler_dir(self, owner: str, sampling_session_id: str) -> str | None:
        """The directory of the sampling session's base model (None for an unknown session:
        the sample itself is refused with the reason)."""
        try:
            return str(self.registry.resolve(self.samplers.get(owner, sampling_session_id).base_model).directory)
        except (NotFoundError, UserError):
            return None

    def _positions(self, owner: str, model_id: str) -> int | None:
        """The run's model's `max_position_embeddings` (None for a run that is not live: the
        op itself is refused with the reason)."""
        try:
            run = self.runs.live(owner, model_id)
        except (NotFoundError, RunNotLoadedError):
            return None
        return max_positions(run.spec.base.directory)

    def _optim_step(self, owner, request: OptimStepRequest) -> Submission:
        adam_params = request.adam_params

        def op(run: LiveRun) -> types.OptimStepResponse:
            want = OPTIMIZERS[run.spec.optimizer].params_type
            if not isinstance(adam_params, want):
                raise UserError(f"optim_step got {params_name(adam_params)}, but this run's optimizer is "
                                f"{run.spec.optimizer}, which takes {want.__name__}")
            metrics = run.require_engine().optim_step(adam_params)
            self.metric_history.record(run.run_id, run.steps, "optim_step", metrics)
            self.runs.step_taken(run)  # counted; the automatic save when one is due
            return types.OptimStepResponse(metrics=metrics)

        return self.runs.submit_op(owner, request.model_id, request.seq_id, "OptimStep", op)

    def _save_weights(self, owner, request: SaveWeightsRequest) -> Submission:
        def op(run: LiveRun) -> types.SaveWeightsResponse:
            row = self.runs.save_checkpoint(run, request.path, "training", request.overwrite, request.ttl_seconds,
                                            request.user_metadata)
            return types.SaveWeightsResponse(path=row.tinker_path)

        return self.runs.submit_op(owner, request.model_id, request.seq_id, "SaveWeights", op)

    def _save_weights_for_sampler(self, owner, request: SaveWeightsForSamplerRequest) -> Submission:
        model_id, seq_id, path, kind = request.model_id, request.seq_id, request.path, request.kind
        sampling_session_seq_id, ttl_seconds, user_metadata = (request.sampling_session_seq_id, request.ttl_seconds,
                                                               request.user_metadata)
        try:
            request.check_target()
        except UserError as exc:
            return self.runs.reject(owner, "SaveWeightsForSampler", str(exc), model_id=model_id)
        try:
            request.check_kind()
        except UserError as exc:
            return self.runs.refuse_op(owner, model_id, seq_id, "SaveWeightsForSampler", exc)
        if path is not None:
            def op(run: LiveRun):
                check_samplable(run.spec)
                row = self.runs.save_checkpoint(run, path, "sampler", True, ttl_seconds, user_metadata)
                if self.samplers.syncs_saved:  # the file is for restarts; samplers get tensors
                    self.samplers.sync_saved(run.run_id, row.tinker_path, run.spec.base,
                                             run.require_engine().named_weights(), run.spec.lora_config,
                                             run.session_id)
                return types.SaveWeightsForSamplerResponseInternal(path=row.tinker_path)
        else:
            def op(run: LiveRun):
                check_samplable(run.spec)
                engine = run.require_engine()
                self._check_new_sampler(run.owner, run.session_id, sampling_session_seq_id)
                sid = self.samplers.create_from_weights(
                    run.owner, run.session_id, sampling_session_seq_id, run.spec.base, engine.named_weights(),
                    run.spec.lora_config, run.run_id, inflight=kind == "inflight", weights_token=run.weights_token,
                )
                return types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sid)
        if seq_id is None:  # unordered (not sent by SDK 0.38.0, which always numbers training calls)
            seq_id = self._next_free_seq(owner, model_id)
        return self.runs.submit_op(owner, model_id, seq_id, "SaveWeightsForSampler", op)

    def save_weights_external(self, owner, model_id, seq_id, path, *, ttl_seconds=None,
                              age_encryption_recipients=None) -> Submission:
        try:
            external.check_export_options(age_encryption_recipients)
            check_ttl(ttl_seconds, self.config.checkpoints)
        except UserError as exc:
            return self.runs.refuse_op(owner, model_id, seq_id, "SaveWeightsExternal", exc)

        def op(run: LiveRun) -> types.SaveWeightsExternalResponseInternal:
            row = self.runs.save_checkpoint(run, path, "external", True, ttl_seconds, None)
            return types.SaveWeightsExternalResponseInternal(path=row.tinker_path, size_bytes=row.size_bytes)

        return self.runs.submit_op(owner, model_id, seq_id, "SaveWeightsExternal", op)

    def _next_free_seq(self, owner: str, model_id: str) -> int | None:
        try:
            return self.runs.live(owner, model_id).seq.next_seq
        except Exception:  # noqa: BLE001 - submit_op reports the unknown/unloaded run
            return 0

    # ------------------------------------------------------------------ sampling
    def create_sampling_session(self, owner, session_id, sampling_session_seq_id, *, base_model=None,
                                model_path=None) -> types.CreateSamplingSessionResponse:
        self.sessions.require_active(owner, session_id)
        self.sessions.touch(session_id)
        self._check_new_sampler(owner, session_id, sampling_session_seq_id)
        sid = self.samplers.create(owner, session_id, sampling_session_seq_id, base_model, model_path)
        return types.CreateSamplingSessionResponse(sampling_session_id=sid)

    def _check_new_sampler(self, owner: str, session_id: str, seq: Any) -> None:
        """`limits.max_sampling_sessions_per_key`, for a sampling session not made yet (a
        retry of one that was made passes)."""
        if isinstance(seq, int) and self.store.sampler_by_seq(session_id, seq) is not None:
            return
        check_sampling_sessions(self.samplers.loaded_count(owner), self.config.limits.max_sampling_sessions_per_key,
                                self.config.sessions.idle_ttl_s, self.config.sessions.heartbeat_timeout_s)

    def get_sampler(self, owner, sampling_session_id) -> types.GetSamplerResponse:
        return self.samplers.get(owner, sampling_session_id)

    def _sample(self, owner, request: SampleRequest) -> Submission:
        sampling_session_id, prompt = request.sampling_session_id, request.prompt
        try:  # before the future reserves num_samples sequence ids and a sampler any memory
            self.config.limits.check_sample(request.num_samples, prompt, request.sampling_params,
                                            request.topk_prompt_logprobs, request.topk_sample_logprobs,
                                            request.prompt_alt_tokens_k)
            if count_images(prompt):
                [prompt] = self._check_images([("prompt", prompt)], owner,
                                              self._sampler_dir(owner, sampling_session_id))
                request = dataclasses.replace(request, prompt=prompt)  # its images checked, pointers read
        except UserError as exc:
            return self.runs.reject(owner, "Sample", str(exc))
        sub = self.samplers.sample(owner, request)
        self._count_samples(owner, sampling_session_id, sub.request_id)
        self.futures.tag_session(sub.request_id, session_of(sampling_session_id))  # busy until it finishes
        self.sessions.touch(session_of(sampling_session_id))
        return sub

    def cancel_sample(self, owner, request_id) -> bool:
        return self.samplers.cancel(owner, request_id)

    # ------------------------------------------------------------------ futures
    def retrieve(self, owner, request_id, timeout_s=0.0) -> FutureState:
        return self.futures.get(owner, request_id, min(float(timeout_s), self.config.retrieve_max_wait_s))

    async def retrieve_async(self, owner, request_id, timeout_s=0.0) -> FutureState:
        return await self.futures.get_async(owner, request_id, min(float(timeout_s), self.config.retrieve_max_wait_s))

    def watch(self, owner: str, request_id: str) -> concurrent.futures.Future:
        """A concurrent Future resolving to the final FutureState (used by the in-process client)."""
        return self.futures.watch(owner, request_id)

    # ------------------------------------------------------------------ REST
    def list_training_runs(self, owner, limit=20, offset=0) -> types.TrainingRunsResponse:
        return rest.list_training_runs(self.store, self.checkpoints, owner, limit, offset)

    def get_training_run(self, owner, run_id) -> types.TrainingRun:
        row = rest.run_row(self.store, owner, run_id)
        return rest.training_run(self.checkpoints, row, self.store.get(SessionRow, row.session_id))

    def list_checkpoints(self, owner, run_id) -> types.CheckpointsListResponse:
        rest.run_row(self.store, owner, run_id)
        return self.checkpoints.list_run(run_id)

    def list_user_checkpoints(self, owner, limit=100, offset=0) -> types.CheckpointsListResponse:
        limit, offset = rest.page(limit, offset)
        return self.checkpoints.list_owner(owner, limit, offset)

    def delete_checkpoint(self, owner, run_id, checkpoint_id) -> None:
        self.checkpoints.delete(owner, run_id, checkpoint_id)
        self._release_synced()

    def set_checkpoint_public(self, owner, run_id, checkpoint_id, public: bool) -> None:
        self.checkpoints.set_public(owner, run_id, checkpoint_id, public)

    def set_checkpoint_ttl(self, owner, run_id, checkpoint_id, ttl_seconds) -> None:
        self.checkpoints.set_ttl(owner, run_id, checkpoint_id, ttl_seconds)

    def sweep_expired_checkpoints(self) -> int:
        """Delete every checkpoint past its expiry (row, then files); how many."""
        removed = self.checkpoints.sweep_expired()
        if removed:
            self._release_synced()
        return removed

    def _release_synced(self) -> None:
        """Memory mode: a deleted checkpoint's tensors go too (`SamplerManager.release_synced`)."""
        self.samplers.release_synced(lambda path: self.checkpoints.row(path) is not None)

    def create_weights_access_token(self, owner, run_id, checkpoint_id, ttl_seconds=None) -> tuple[str, int]:
        return self.checkpoints.access_token(owner, run_id, checkpoint_id, ttl_seconds)

    def external_weights_links(self, owner, run_id, checkpoint_id) -> ExternalWeightsLinks:
        return self.checkpoints.external_links(owner, run_id, checkpoint_id)

    def open_external_weights_file(self, token, file) -> str:
        return self.checkpoints.open_external_file(token, file)

    def get_weights_info(self, owner, tinker_path) -> types.WeightsInfoResponse:
        return self.checkpoints.weights_info(owner, tinker_path)

    def metric_history_of(self, owner, run_id) -> dict[str, Any]:
        rest.run_row(self.store, owner, run_id)
        return self.metric_history.history(run_id)

    def sequence_provenance(self, owner, session_id, sequence_id) -> dict[str, Any]:
        try:
            return self.records.provenance(owner, session_id, sequence_id)
        except UserError as exc:  # another owner's record reads exactly as a missing one
            raise NotFoundError(str(exc)) from None

    @property
    def data_dir(self) -> Path:
        return self.config.data_dir

    def owner_state(self, owner) -> OwnerOverview:
        live = self.runs.live_runs_of(owner)
        return OwnerOverview(queue_depths={rid: run.seq.queued for rid, run in live.items()},
                             futures_pending=self.futures.pending_count_of(owner),
                             samplers_loaded=self.samplers.loaded_count(owner))

    def server_state(self) -> ServerState:
        lanes = self.runs.lane_depths()
        samples, _ = self.samplers.queued.total()
        return ServerState(runs=sum(n for n, _ in lanes.values()), sessions=len(self.store.active_sessions()),
                           samplers=self.samplers.loaded_total(), lanes=lanes, samples_queued=samples,
                           futures_pending=self.futures.pending_count())

    def run_facts(self, owner, run_ids: Sequence[str]) -> dict[str, RunFacts]:
        live = self.runs.live_runs_of(owner)
        stored = self.store.steps_taken([r for r in run_ids if r not in live])
        out = {}
        for rid in run_ids:
            row = rest.run_row(self.store, owner, rid)
            run = live.get(rid)
            out[rid] = RunFacts(steps=run.steps if run is not None else stored.get(rid, 0),
                                loaded=run is not None and run.error is None,
                                head=run.spec.head if run is not None else None, created=row.created_at)
        return out

    def session_facts(self, owner, session_id) -> SessionFacts:
        row = self.sessions.row(owner, session_id)
        return SessionFacts(id=row.id, status=row.status, finish_reason=row.finish_reason,
                            finish_detail=row.finish_detail, display_name=row.display_name, created_at=row.created_at,
                            last_heartbeat=row.last_heartbeat, sdk_version=row.sdk_version, tags=row.tags,
                            user_metadata=row.user_metadata)

    def gauges(self) -> ServiceGauges:
        return ServiceGauges(futures_pending=self.futures.pending_count(), run_queue_depths=self.runs.queue_depths(),
                             replicas=self.samplers.replica_stats(), sampler_load=self.samplers.sampler_load())

    def checkpoint_bytes(self, owner) -> int:
        return self.checkpoints.bytes_used(owner)

    def future_owner(self, request_id) -> str | None:
        return self.futures.owner_of(request_id)

    def add_future_listener(self, fn: Callable[[FutureState], None]) -> None:
        self.futures.add_listener(fn)

    def add_weight_sync_listener(self, fn: Callable[[str, float], None]) -> None:
        self.samplers.add_sync_listener(fn)

    def get_server_capabilities(self) -> types.GetServerCapabilitiesResponse:
        return rest.capabilities(self.registry, self.config.limits)

    def base_model_directory(self, base_model: str) -> str:
        return str(self.registry.resolve(base_model).directory)

    # ------------------------------------------------------------------ inspection (read-only)
    def debug_state(self, futures: Sequence[str] = ()) -> ServiceDebugState:
        """The one inspection point of a Service (read-only): what it holds now, as a
        `ServiceDebugState`; `futures`: the request ids whose database rows to include."""
        return ServiceDebugState(
            engine_factory=self.runs.factory, runs=self.runs.all_live_runs(), samplers=self.samplers.debug_state(),
            unsaved_futures=self.futures.unsaved_count(),
            futures={rid: self.store.get(FutureRow, rid) for rid in futures})

    # ------------------------------------------------------------------ lifecycle
    def close(self, save_runs: bool = False) -> None:
        """`save_runs`: a clean stop of `ember serve` (`RunManager.shutdown`): accepted
        requests finish within `runs.shutdown_drain_s`, then every loaded run is saved
        and comes back on its next request after a restart (README "Restarts")."""
        if self._closed.is_set():
            return
        self._closed.set()
        if save_runs and self.config.runs.save_on_shutdown:
            drain_s = self.config.runs.shutdown_drain_s
            deadline = time.monotonic() + drain_s  # one bound for training ops and samples alike
            self.samplers.stop_taking()
            saved = self.runs.shutdown(drain_s)
            if saved:
                log.info("%d training run(s) saved; they come back when their clients call again", saved)
            cut = self.samplers.drain(deadline - time.monotonic())
            if cut:
                log.warning("%d sample(s) still running after runs.shutdown_drain_s=%s failed (their clients "
                            "sample again after the restart)", cut, drain_s)
        self.runs.close()
        self.samplers.close()
        self.image_admission.close()
        self.metric_history.close()
        self.futures.fail_all_pending("the service was shut down before this request finished")
        self.store.close()
        self._data_lock.release()

    def _persist_snapshots(self, run: LiveRun) -> None:
        """After a run's automatic save (on its lane): the sampling sessions that
        snapshot its weights, current or older, are saved beside it (`SamplerManager.persist_snapshots`)."""
        if run.engine is not None:
            self.samplers.persist_snapshots(self.checkpoints, run.run_id, run.owner, run.weights_token,
                                            run.engine.export_hf)

    def __enter__(self) -> "Service":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def export_weights(self, owner: str, run_id: str, name: str = "console-export") -> Submission:
        """The loaded run's current weights in Hugging Face format, as the checkpoint
        tinker://<run>/external_weights/<name> (replaced if present). Outside the run's seq_id
        order (the console's button must not take a number its client will send): queued on
        the run's lane, it runs between two of the client's ops."""
        try:
            run = self.runs.live(owner, run_id)
        except RunNotLoadedError as exc:
            raise UserError(str(exc)) from None
        sub, _ = self.futures.create(owner, "SaveWeightsExternal", model_id=run_id)

        def op() -> types.SaveWeightsExternalResponseInternal:
            row = self.runs.save_checkpoint(run, name, "external", True, None, None)
            return types.SaveWeightsExternalResponseInternal(path=row.tinker_path, size_bytes=row.size_bytes)

        try:
            with self.futures.accepting(sub.request_id):  # a closed lane fails the future too
                run.lane.submit(lambda: self.runs.execute(sub.request_id, op), owner)
        except RuntimeError as exc:
            raise UserError(f"training run {run_id} cannot export now: {exc}") from None
        return sub

    def _count_samples(self, owner: str, sampling_session_id: str, request_id: str) -> None:
        """A sample of a sampler made from a run of its own session counts into that run's
        metric history when it completes (tokens sampled, completion length per step)."""
        if sampling_session_id not in self._sampler_runs:
            row = self.store.get(SamplerRow, sampling_session_id)
            source = None if row is None else row.source_run_id or (
                (row.model_path or "").removeprefix("tinker://").split("/")[0] or None)
            same = row is not None and row.owner == owner and source and source.split(":")[0] == row.session_id
            if len(self._sampler_runs) >= 4096:
                self._sampler_runs.clear()  # a bound, not a cache policy: rebuilt one lookup at a time
            self._sampler_runs[sampling_session_id] = source if same else None
        run_id = self._sampler_runs[sampling_session_id]
        if run_id is None or not self.config.metric_history_rows:
            return

        def done(fut: concurrent.futures.Future) -> None:
            if fut.exception() is None and fut.result().status == "complete":
                self.metric_history.add_samples(run_id, fut.result().result)

        self.futures.watch(owner, request_id).add_done_callback(done)

    # ------------------------------------------------------------------ operator (no owner check)
    def operator_view(self, owners: Sequence[str] = ()) -> dict[str, Any]:
        """Every active session and loaded run, and per owner (`owners` and every owner of
        one): runs, checkpoints, checkpoint bytes (`ember admin`, the console's operator page)."""
        now, live = self._clock(), self.runs.all_live_runs()
        sessions = self.store.active_sessions()
        everyone = sorted({*owners, *(s.owner for s in sessions), *(r.owner for r in live.values())})
        out: dict[str, Any] = {"sessions": [operator_session(s, now, live) for s in sessions],
                               "runs": [], "checkpoints": [], "owners": {}}
        for owner in everyone:
            runs = self.list_training_runs(owner, 100, 0)
            ckpts = self.list_user_checkpoints(owner, 100, 0)
            out["runs"] += [operator_run(r, live.get(r.training_run_id)) for r in runs.training_runs]
            out["checkpoints"] += [{"owner": owner, **c.model_dump(mode="json")} for c in ckpts.checkpoints]
            out["owners"][owner] = {"runs": runs.cursor.total_count, "sessions_active": sum(
                s.owner == owner for s in sessions), "runs_loaded": sum(r.owner == owner for r in live.values()),
                "checkpoints": ckpts.cursor.total_count, "checkpoint_bytes": self.checkpoints.bytes_used(owner)}
        return out

    def operator_end_session(self, session_id: str) -> None:
        """End any key's active session as a lost client's is ended: its runs saved, then unloaded."""
        row = self.store.get(SessionRow, session_id)
        if row is None:
            raise NotFoundError(f"unknown session {session_id!r}")
        if not self.sessions.finish(row.owner, session_id, "interrupted", "ended by the operator"):
            raise UserError(f"session {session_id} is already {row.status}")
        self._on_session_expired(session_id)

    def operator_unload_run(self, run_id: str) -> str:
        """Unload any key's loaded run, saved first; the checkpoint its owner resumes from.
        Returns once it is saved, after the requests queued before it: waits up to
        `runs.shutdown_drain_s`, then says so in the log and lets the save finish behind."""
        done = self.runs.unload_run(run_id, save_as=SESSION_END_CHECKPOINT)
        if done is None:
            raise UserError(f"training run {run_id!r} is not loaded")
        if not done.wait(self.config.runs.shutdown_drain_s):
            log.warning("run %s is still saving after runs.shutdown_drain_s=%s (requests queued before the "
                        "unload run first); it is saved and unloaded when they end", run_id,
                        self.config.runs.shutdown_drain_s)
        return f"tinker://{run_id}/weights/{SESSION_END_CHECKPOINT}"


def operator_session(row: SessionRow, now: float, live: Mapping[str, LiveRun]) -> dict[str, Any]:
    return {"session_id": row.id, "owner": row.owner, "display_name": row.display_name,
            "created_at": row.created_at, "heartbeat_age_s": round(now - row.last_heartbeat, 1),
            "runs_loaded": sum(r.session_id == row.id for r in live.values())}


def operator_run(run: types.TrainingRun, live: LiveRun | None) -> dict[str, Any]:
    return {"run_id": run.training_run_id, "owner": run.model_owner, "base_model": run.base_model,
            "loaded": live is not None, "steps": live.steps if live is not None else None,
            "failed": run.corrupted, "last_request_time": run.last_request_time.isoformat()
            if run.last_request_time else None}


def build_service(config: ServiceConfig, workers: WorkersConfig | None = None) -> Service:
    """The service `config` describes, its engines on the worker group `workers` asks for
    (in process by default). The one constructor `ember serve` and `ember.ServiceClient`
    share: a service that fails to start never leaves a started worker group behind.
    Ray sampler replicas (`sampler.placement = "ray"`) join the cluster the worker groups
    use (`workers.ray_address`; README "Scaling out")."""
    workers = workers or WorkersConfig()
    if config.sampler.placement == "ray":
        from ember.sampling.ray_replica import use_cluster

        use_cluster(workers.ray_address)
    check_cp_layout(config.models, workers)  # before a worker group starts
    check_ep_layout(config.models, workers)
    factory = engine_factory_for(workers, config.engine)
    try:
        return Service(config, engine_factory=factory)
    except BaseException:
        factory.close()
        raise


def check_ep_layout(models: dict[str, str], workers: WorkersConfig) -> None:
    """ValueError naming the model, `parallel.ep` and its experts per layer when `workers`'
    ep does not divide a registered mixture-of-experts model's experts
    (`ember.engine.parallel.check_ep_model`; dense models ignore ep)."""
    ep = workers.parallel_dims().get("ep", 1)
    if ep == 1:
        return
    from ember.engine.estimate import load_config
    from ember.engine.parallel import check_ep_model

    for name, directory in models.items():
        try:
            check_ep_model(load_config(directory), ep)
        except ValueError as exc:
            raise ValueError(f"model {name!r}: {exc}") from None


def check_cp_layout(models: dict[str, str], workers: WorkersConfig) -> None:
    """ValueError naming `parallel.cp` and the model when `workers`' cp does not divide the
    attention heads of a registered model (`ember.engine.parallel.check_cp_heads`). Models
    found later under a model root get the same error when a run is created on the ranks."""
    dims = workers.parallel_dims()
    cp = dims.get("cp", 1)
    if cp == 1:
        return
    from ember.engine.estimate import load_config
    from ember.engine.parallel import check_cp_heads

    for name, directory in models.items():
        try:
            check_cp_heads(load_config(directory), cp, key="parallel.cp", tp=dims["tp"])
        except ValueError as exc:
            raise ValueError(f"model {name!r}: {exc}") from None
