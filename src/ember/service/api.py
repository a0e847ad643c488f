"""`ServiceAPI`: the multi-tenant core's public interface (no HTTP in it).

The HTTP server (`ember.server`) and the in-process client (`ember.client`) both talk to a
service only through this interface. Its methods mirror Tinker's endpoints
(docs/protocol.md §2): arguments are the request fields, already parsed into tinker
types; results are tinker types, so the server only translates them to the wire format.
A submission's fields travel as one typed request (`ember.service.requests`) from the
route through `submit` to the manager; its keyword method (`sample`, `forward_backward`,
...) builds that request for in-process callers. The console and `/metrics` read only
the views below (`owner_state`, `run_facts`, `session_facts`, `gauges`, ...).

Construction (implementation in `ember.service.core`)::

    from ember.service import Service, ServiceConfig
    service = Service(ServiceConfig(data_dir="/var/ember", models={"Qwen/Qwen3-0.6B": "/models/qwen3"},
                                    database_url=None))   # None -> sqlite:///<data_dir>/ember.db
    ...
    service.close()

`Service(config, engine_factory=..., sampler_factory=...)` takes the seams for scale-out:
`ember.service.engines.EngineFactory` (default `LocalEngineFactory`: in-process
TorchEngines, LoRA adapters sharing one base model; `WorkerGroupEngineFactory` runs
engines on an `ember.workers.WorkerGroup`) and `ember.service.samplers.SamplerFactory`
(default: `LocalSamplerFactory`: one sampler per base model, of the backend
`SamplerConfig.backend` names, or a `SamplerPool` of them with `[sampler.pool] replicas` > 1).

Conventions
-----------
* **owner**: every call takes the caller's identity first (the API key's identity on the
  server; `"local"` in process). Sessions, runs, samplers, checkpoints and futures are
  visible only to their owner; something owned by another owner is reported exactly like
  something that does not exist (`NotFoundError`), so ids cannot be probed.
* **Direct calls** (sessions, `get_info`, `create_sampling_session`, `get_sampler`, REST
  listings) return their result or raise a `ServiceError` subclass (mapping to HTTP:
  `UserError` 400, `NotFoundError` 404, `SessionGoneError` 410, `BusyError` 429, `ServerError` 500).
* **Submissions** (`create_model`, `load_weights`, `forward_backward`, `optim_step`,
  `save_weights`, `save_weights_for_sampler`, `save_weights_external`, `sample`) return a
  `Submission` at once and never block on the work. They raise only for malformed arguments that the caller should
  have rejected itself (a `UserError`, e.g. a negative seq_id), or `BusyError` when the
  server cannot take them now (retry later). Every *semantic* failure
  (unknown model or base model, unknown loss, bad datum, duplicate checkpoint name,
  non-finite gradient, ...) is reported through the future as
  `FutureState(status="failed", category=User)`, never as an exception: the SDK retries
  HTTP errors for minutes, but shows a failed future to the user at once.
* **Ordering** (docs/architecture.md contract 3): requests of one training run (every submission
  that carries a `seq_id`) execute in `seq_id` order. After `create_model` the next
  expected seq_id is 1; a run created by `load_weights(session_id=..., model_seq_id=...)`
  counts that load as seq 0, so the next is also 1. A missing seq_id is waited for at
  most `ServiceConfig.seq_gap_timeout_s` (counted from the moment the run is idle with a
  later request waiting), then skipped with a logged warning; if it arrives afterwards it
  fails with category `server` ("arrived after it was skipped").
* **Idempotency**: resubmitting the same key returns the *same* `Submission`
  (same request_id, nothing executed twice). Keys: `(session_id, model_seq_id)` for
  `create_model` / create-via-`load_weights`; `(model_id, seq_id)` for training calls;
  `(session_id, sampling_session_seq_id)` for `create_sampling_session` and for
  `save_weights_for_sampler` with a `sampling_session_seq_id`;
  `(sampling_session_id, seq_id)` for `sample`.
* **Futures** are kept (in the database) after retrieval, so a retry after a network
  error, or a retrieve after a server restart, still gets the result. Requests that were
  accepted but not finished when the server died answer
  `failed / category=server / "... the server restarted ..."`.
* **Threading**: every method is thread-safe and, except `retrieve`, returns quickly.
  `retrieve(timeout_s=...)` blocks up to `timeout_s`; an asyncio server should call
  `retrieve_async`, which waits without holding a thread.
"""

from __future__ import annotations

import abc
import concurrent.futures
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict

from tinker import types

from ember.errors import ServerError, ServiceError, UserError  # their home; exported from here too
from ember.service.requests import (
    CreateModelRequest, CreateSessionRequest, ForwardBackwardRequest, LoadWeightsRequest, OptimStepRequest,
    SampleRequest, SaveWeightsForSamplerRequest, SaveWeightsRequest, SubmitRequest,
)

__all__ = [
    "FutureStatus",
    "ExternalWeightsLinks",
    "FutureState",
    "NotFoundError",
    "OwnerOverview",
    "RequestType",
    "RunFacts",
    "ServerState",
    "ServiceGauges",
    "SessionFacts",
    "BusyError",
    "ServerError",
    "ServiceAPI",
    "ServiceError",
    "SessionGoneError",
    "Submission",
    "UserError",
]

# The values of the SDK's `X-Tinker-Request-Type` header, one per kind of future.
RequestType = Literal[
    "CreateModel",
    "ForwardBackward",
    "Forward",
    "OptimStep",
    "SaveWeights",
    "LoadWeights",
    "SaveWeightsForSampler",
    "SaveWeightsExternal",
    "Sample",
]
# Result types per request type (what `FutureState.result` holds when complete):
#   CreateModel            -> types.CreateModelResponse
#   ForwardBackward/Forward-> types.ForwardBackwardOutput   (protobuf on the wire)
#   OptimStep              -> types.OptimStepResponse
#   SaveWeights            -> types.SaveWeightsResponse
#   LoadWeights            -> types.LoadWeightsResponse
#   SaveWeightsForSampler  -> types.SaveWeightsForSamplerResponseInternal
#                             (`path` set for a named save, `sampling_session_id` set
#                             when a sampling_session_seq_id was given)
#   SaveWeightsExternal    -> types.SaveWeightsExternalResponseInternal(path, size_bytes)
#   Sample                 -> types.SampleResponse (sequence_id of sequence i is
#                             Submission.sample_sequence_ids[i]; protobuf on the wire)

FutureStatus = Literal["pending", "complete", "failed"]


class NotFoundError(UserError, LookupError):
    """Unknown id, or an id owned by someone else (HTTP 404)."""


class SessionGoneError(UserError):
    """The session was finished or expired (HTTP 410 on heartbeat)."""


class BusyError(ServiceError):
    """The server cannot take this request now; the same request later can (HTTP 429 with
    Retry-After, which the SDK retries). Raised by a submission before any future is made,
    e.g. a key over its share of image decoding (`ember.service.image_admission`)."""

    category = types.RequestErrorCategory.Server
    retry_after_s = 1


@dataclass(frozen=True)
class Submission:
    """What a submission answers at once (the wire's UntypedAPIFuture)."""

    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None  # only for `sample`: one per requested sample


@dataclass(frozen=True)
class FutureState:
    """One answer of `retrieve`.

    status "pending":  not finished within the wait; the server answers `try_again`
                       (`queue_state` is "active" unless the service is paused).
    status "complete": `result` holds the tinker type listed under `RequestType`.
    status "failed":   `error` (human-readable, names datum index / field where relevant)
                       and `category` (User for bad input, Server for our faults).
    """

    request_id: str
    request_type: RequestType
    status: FutureStatus
    result: Any = None
    error: str | None = None
    category: types.RequestErrorCategory | None = None
    queue_state: Literal["active", "paused_capacity", "paused_rate_limit"] = "active"
    model_id: str | None = None

    @property
    def done(self) -> bool:
        return self.status != "pending"


@dataclass(frozen=True)
class ExternalWeightsLinks:
    """An external-weights export's files (paths relative to its directory, '/'-separated)
    and one token that unlocks them until `expires` (a Unix time)."""

    tinker_path: str
    directory: str
    files: list[str]
    token: str
    expires: float


class OwnerOverview(TypedDict):
    """What the server holds for one owner now (the console's overview; no database)."""

    queue_depths: dict[str, int]  # loaded run -> requests queued in its sequencer
    futures_pending: int
    samplers_loaded: int


class ServerState(TypedDict):
    """What the server holds now over every owner (the periodic status line)."""

    runs: int
    sessions: int
    samplers: int
    lanes: dict[str, tuple[int, int]]  # lane -> (live runs on it, requests queued in their sequencers)
    samples_queued: int
    futures_pending: int


class RunFacts(TypedDict):
    """One run's live facts for the console's listings: steps taken (from the live run,
    else the metric history), whether it is loaded, its head, when it was created."""

    steps: int
    loaded: bool
    head: str | None
    created: Any  # the run's creation time as stored (a datetime)


@dataclass(frozen=True)
class SessionFacts:
    """One session as the console shows it (liveness, names, tags, metadata)."""

    id: str
    status: str  # active | finished | expired
    finish_reason: str | None  # success | errored | interrupted, once not active
    finish_detail: str | None
    display_name: str | None
    created_at: float
    last_heartbeat: float
    sdk_version: str | None
    tags: list[str] | None
    user_metadata: dict[str, Any] | None


@dataclass(frozen=True)
class ServiceGauges:
    """What `/metrics` reads at scrape time: futures pending, each live run's queued
    requests, sampler replicas (per pooled base model: `up`, `requests_total`, `in_flight`)
    and sampler load (per base model: `active_slots`, `waiting_requests`)."""

    futures_pending: int = 0
    run_queue_depths: Mapping[str, int] = field(default_factory=dict)
    replicas: Mapping[str, list[dict[str, Any]]] = field(default_factory=dict)
    sampler_load: Mapping[str, Mapping[str, int]] = field(default_factory=dict)


class ServiceAPI(abc.ABC):
    """The multi-tenant service. See the module docstring for the conventions."""

    # ------------------------------------------------------------------ sessions
    @abc.abstractmethod
    def open_session(self, owner: str, request: CreateSessionRequest) -> types.CreateSessionResponse:
        """Open a session (one per ServiceClient). Returns its id ("sess-<hex>")."""

    def create_session(self, owner: str, **fields: Any) -> types.CreateSessionResponse:
        """`open_session(owner, CreateSessionRequest(**fields))`: tags, user_metadata,
        project_id, display_name, sdk_version."""
        return self.open_session(owner, CreateSessionRequest(**fields))

    @abc.abstractmethod
    def heartbeat(self, owner: str, session_id: str) -> None:
        """Keep a session alive. Raises SessionGoneError if finished/expired (→ HTTP 410)."""

    @abc.abstractmethod
    def finish_session(
        self, owner: str, session_id: str, reason: str = "success", detail: str | None = None
    ) -> None:
        """Close a session (`reason` ∈ success|errored|interrupted). Its runs take no new
        requests (failed, category server), finish what is queued, then free their engines
        (LoRA adapters leave the shared model); its sampling sessions are dropped; its
        checkpoints and futures stay (they outlive sessions). Idempotent."""

    @abc.abstractmethod
    def expire_sessions(self) -> list[str]:
        """Expire sessions without a heartbeat for `sessions.heartbeat_timeout_s`, or idle
        for `sessions.idle_ttl_s`; save their loaded runs (`tinker://<run>/weights/session-end`)
        and unload them (checkpoints stay). Returns the expired ids. The service calls this
        itself periodically (housekeeping); a caller may run an expiry sweep now."""

    @abc.abstractmethod
    def get_session(self, owner: str, session_id: str) -> types.GetSessionResponse: ...

    @abc.abstractmethod
    def list_sessions(self, owner: str, limit: int = 20, offset: int = 0) -> types.ListSessionsResponse: ...

    # ------------------------------------------------------------- training runs
    @abc.abstractmethod
    def submit(self, owner: str, request: SubmitRequest) -> Submission:
        """Submit one request (`ember.service.requests`: the fields are the call's arguments);
        what each does is told at its keyword method below (`create_model`, `load_weights`,
        `forward_backward`, `optim_step`, `save_weights`, `save_weights_for_sampler`, `sample`),
        which builds the request from its arguments and submits it. Another type → UserError."""

    def create_model(self, owner: str, *args: Any, **fields: Any) -> Submission:
        """Create a training run with model id f"{session_id}:train:{model_seq_id}".

        `lora_config` None means full fine-tuning (a private copy of the base model);
        otherwise a named LoRA adapter on the shared base model. `base_model` is a
        registered name or a local model directory. Future → CreateModelResponse.
        Unknown base model / bad LoRA config / unsupported optimizer → failed, user.
        """
        return self.submit(owner, CreateModelRequest(*args, **fields))

    @abc.abstractmethod
    def get_info(self, owner: str, model_id: str) -> types.GetInfoResponse:
        """Direct. model_data = {arch, model_name (base model name), tokenizer_id (a local
        directory)}, is_lora, lora_rank. Raises NotFoundError until create_model/
        create-via-load has registered the run (the server should answer 404; the SDK
        only calls it after the creation future completed)."""

    def load_weights(self, owner: str, *args: Any, **fields: Any) -> Submission:
        """Load a `tinker://<run>/weights/<name>` checkpoint (state saved by `save_weights`).

        Two addressing modes (exactly one must be given, else UserError):
        * `model_id` + `seq_id`: into the existing run (an ordered op of that run);
        * `session_id` + `model_seq_id`: create-via-load — a new run
          f"{session_id}:train:{model_seq_id}" with the checkpoint's base model and LoRA
          config; the load is its seq 0.
        `optimizer=False` starts a fresh optimizer (step 0): `optimizer_config` (the SDK's
        `create_training_client_from_state(optimizer=...)`; default AdamW) when creating a
        run, else the run's own. `optimizer=True` restores the checkpoint's optimizer and its
        state; an `optimizer_config` of another type is then a user error. Future → LoadWeightsResponse
        (path, model_id). Unknown/foreign path → failed, user. Another key's private
        checkpoint loads when `weights_access_token` is one its owner made for it
        (`create_weights_access_token`); any other token for it → failed, user, saying so.
        """
        return self.submit(owner, LoadWeightsRequest(*args, **fields))

    def forward_backward(self, owner: str, *args: Any, **fields: Any) -> Submission:
        """Ordered op. Future (request type ForwardBackward, or Forward when forward_only)
        → ForwardBackwardOutput with per-datum `logprobs` (+ `elementwise_loss`) and metrics
        {"loss:sum": ...} (keys always have exactly one colon). Gradients accumulate until
        optim_step. Bad datum / unknown loss / bad config → failed, user (engine's message)."""
        return self.submit(owner, ForwardBackwardRequest(*args, **fields))

    def optim_step(self, owner: str, *args: Any, **fields: Any) -> Submission:
        """Ordered op. Future → OptimStepResponse(metrics). A non-finite gradient →
        failed, user ("non-finite gradient ..."); weights and Adam state stay untouched."""
        return self.submit(owner, OptimStepRequest(*args, **fields))

    def save_weights(self, owner: str, *args: Any, **fields: Any) -> Submission:
        """Ordered op (the SDK's `save_state`): weights + optimizer state + step, stored under
        the data directory. `path` is a checkpoint *name* ([A-Za-z0-9_.-]+, no "..";
        violations → failed, user). Future → SaveWeightsResponse(path=
        "tinker://<model_id>/weights/<name>"). Existing name without overwrite → failed, user."""
        return self.submit(owner, SaveWeightsRequest(*args, **fields))

    def save_weights_for_sampler(self, owner: str, *args: Any, **fields: Any) -> Submission:
        """Ordered op (when seq_id is not None). Exactly one of `path` (a name) and
        `sampling_session_seq_id` must be given.

        * name: exports the current weights as safetensors → SaveWeightsForSamplerResponseInternal(
          path="tinker://<model_id>/sampler_weights/<name>").
        * sampling_session_seq_id: snapshots the current weights (immutable, contract 4)
          into a new sampling session of the run's session (idempotent on
          (session_id, sampling_session_seq_id)) → ...Internal(sampling_session_id=...).
          `kind="inflight"`: the weights also become the run's in-flight target; this
          sampling session and the run's earlier in-flight ones sample from the newest
          target from their next request on (docs/architecture.md#in-flight-weights).
        """
        return self.submit(owner, SaveWeightsForSamplerRequest(*args, **fields))

    @abc.abstractmethod
    def save_weights_external(
        self,
        owner: str,
        model_id: str,
        seq_id: int,
        path: str,
        *,
        ttl_seconds: int | None = None,
        age_encryption_recipients: Sequence[str] | None = None,
    ) -> Submission:
        """Ordered op: the current weights in Hugging Face format (a peft adapter for LoRA
        runs, a transformers model directory for full FT; `ember.service.external`), as the
        checkpoint "tinker://<model_id>/external_weights/<name>" (an existing one is replaced).
        Future → SaveWeightsExternalResponseInternal(path, size_bytes). Encryption
        (`age_encryption_recipients`) is not supported → failed, user."""

    @abc.abstractmethod
    def create_weights_access_token(self, owner: str, run_id: str, checkpoint_id: str,
                                    ttl_seconds: int | None = None) -> tuple[str, int]:
        """Direct. (token, expires as a Unix time): a `weights_access_token` that lets any
        API key load the owner's private "weights/<name>" checkpoint for `ttl_seconds`
        (default 7 days, at most `checkpoints.max_ttl_s`) or until it is overwritten or
        deleted. Unknown, foreign or expired → NotFoundError; sampler weights → UserError."""

    @abc.abstractmethod
    def external_weights_links(self, owner: str, run_id: str, checkpoint_id: str) -> ExternalWeightsLinks:
        """Direct. The files of an external-weights checkpoint ("external_weights/<name>")
        and a token that unlocks them for `open_external_weights_file` until it expires.
        Unknown or foreign → NotFoundError; another kind of checkpoint → UserError."""

    @abc.abstractmethod
    def open_external_weights_file(self, token: str, file: str) -> str:
        """Direct, without an owner (the token is the authority): the local path of one
        file of the export the token names. Forged, expired or revoked tokens (the export
        was deleted or overwritten) and files the export does not hold → NotFoundError."""

    # ----------------------------------------------------------------- sampling
    @abc.abstractmethod
    def create_sampling_session(
        self,
        owner: str,
        session_id: str,
        sampling_session_seq_id: int,
        *,
        base_model: str | None = None,
        model_path: str | None = None,
    ) -> types.CreateSamplingSessionResponse:
        """Direct. A sampler on a base model (registered name or directory) or on a
        checkpoint (`tinker://<run>/sampler_weights/<name>` or `.../weights/<name>`).
        Exactly one of base_model / model_path (else UserError); unknown → NotFoundError
        (unknown base model → UserError). Idempotent on (session_id, sampling_session_seq_id)."""

    @abc.abstractmethod
    def get_sampler(self, owner: str, sampling_session_id: str) -> types.GetSamplerResponse:
        """Direct: {sampler_id, base_model, model_path?}."""

    def sample(self, owner: str, *args: Any, **fields: Any) -> Submission:
        """Submit a sample (and `compute_logprobs`, which is a 1-token sample with
        include_prompt_logprobs=True). Returns request_id and `sample_sequence_ids`
        (num_samples strings); the future's SampleResponse has exactly that many
        sequences, `sequence_id`s set to them. Bad prompt/params → failed, user.
        `record_stability_info`: each sequence is recorded (owner- and session-scoped,
        expiring) before the future completes, for `stable_reinforce` datums whose
        provenance names it (`ember.service.stability`).
        `on_tokens(sample, tokens, logprobs)`: called with each sample's tokens as they are
        decoded (`ember.sampling.base.submit_streaming`; on the sampler's thread, keep it short)."""
        return self.submit(owner, SampleRequest(*args, **fields))

    def cancel_sample(self, owner: str, request_id: str) -> bool:
        """Give up on a running sample (a streaming client hung up): its sampler slots are
        freed and its future fails. False when it is not running. This default cancels nothing."""
        return False

    # ------------------------------------------------------------------ futures
    @abc.abstractmethod
    def retrieve(self, owner: str, request_id: str, timeout_s: float = 0.0) -> FutureState:
        """State of a future, waiting up to `timeout_s` for it to finish (long-poll).
        Unknown/foreign request_id → NotFoundError."""

    @abc.abstractmethod
    async def retrieve_async(self, owner: str, request_id: str, timeout_s: float = 0.0) -> FutureState:
        """As `retrieve`, awaiting completion on the running event loop (no thread held)."""

    def watch(self, owner: str, request_id: str) -> concurrent.futures.Future:
        """A `concurrent.futures.Future` resolving to the final FutureState (used by the
        in-process client). This default polls `retrieve` on a daemon thread; `Service`
        overrides it with a callback (no thread, no polling)."""
        self.retrieve(owner, request_id)  # unknown/foreign ids raise here, not in the thread
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def poll() -> None:
            try:
                while not (state := self.retrieve(owner, request_id, 25.0)).done:
                    pass
                fut.set_result(state)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(exc)

        threading.Thread(target=poll, name=f"ember-watch-{request_id}", daemon=True).start()
        return fut

    # --------------------------------------------------------------------- REST
    @abc.abstractmethod
    def list_training_runs(self, owner: str, limit: int = 20, offset: int = 0) -> types.TrainingRunsResponse:
        """The owner's runs, newest first; cursor {offset, limit, total_count}. Runs of
        earlier server lifetimes are listed too (their `corrupted` stays False; they can be
        recreated from their last checkpoint with load_weights(session_id=..., ...))."""

    @abc.abstractmethod
    def get_training_run(self, owner: str, run_id: str) -> types.TrainingRun: ...

    @abc.abstractmethod
    def metric_history_of(self, owner: str, run_id: str) -> dict[str, Any]:
        """The run's per-step metrics (`ember.service.metric_history.MetricHistory.history`):
        {run_id, steps_taken, max_rows, rows: [{step, kind, metrics, time}]}, oldest first."""

    @abc.abstractmethod
    def sequence_provenance(self, owner: str, session_id: str, sequence_id: str) -> dict[str, Any]:
        """ember's own: what the server recorded of one sampled sequence of `session_id` (a
        sampling client made with `record_stability_info=True`): {session_id, sequence_id,
        num_tokens, version_spans: [{first_token, generation}] or None, spans_a_swap}.
        `generation` is the run's in-flight save count (1 for its first `kind="inflight"` save)
        whose weights drew the tokens from `first_token` on; None: one version throughout (the
        request's). `NotFoundError` when the record does not exist for this owner and session,
        expired or was evicted (docs/architecture.md#in-flight-weights)."""

    @abc.abstractmethod
    def list_checkpoints(self, owner: str, run_id: str) -> types.CheckpointsListResponse: ...

    @abc.abstractmethod
    def list_user_checkpoints(self, owner: str, limit: int = 100, offset: int = 0) -> types.CheckpointsListResponse: ...

    @abc.abstractmethod
    def delete_checkpoint(self, owner: str, run_id: str, checkpoint_id: str) -> None:
        """`checkpoint_id` as in REST paths: "weights/<name>" or "sampler_weights/<name>"."""

    @abc.abstractmethod
    def set_checkpoint_public(self, owner: str, run_id: str, checkpoint_id: str, public: bool) -> None:
        """Publish (readable by every API key: sampling, loading, weights info) or unpublish
        a checkpoint. Owner only; idempotent (publishing a public one changes nothing).
        Unknown, foreign or expired → NotFoundError."""

    @abc.abstractmethod
    def set_checkpoint_ttl(self, owner: str, run_id: str, checkpoint_id: str, ttl_seconds: int | None) -> None:
        """Expire the checkpoint `ttl_seconds` from now (1..checkpoints.max_ttl_s; None = never;
        else UserError). Owner only; unknown, foreign or expired → NotFoundError."""

    @abc.abstractmethod
    def get_weights_info(self, owner: str, tinker_path: str) -> types.WeightsInfoResponse:
        """Of a checkpoint the owner may read (its own, or a published one)."""

    @abc.abstractmethod
    def get_server_capabilities(self) -> types.GetServerCapabilitiesResponse:
        """The registered base models (trainable and sampleable)."""

    @abc.abstractmethod
    def base_model_directory(self, base_model: str) -> str:
        """The local directory of a base model (a registered name, or a path the registry
        accepts), where its tokenizer lives; unknown → UserError. Used by the
        OpenAI-compatible routes to tokenize text."""

    # ---------------------------------------------------------------- lifecycle
    @abc.abstractmethod
    def close(self, save_runs: bool = False) -> None:
        """Stop executor threads (in-flight work is abandoned; after a restart those
        futures answer category server) and close the database. Idempotent.
        `save_runs` (a server's clean stop): accepted requests finish first, within a bound,
        and every loaded run is saved, to come back on its next request after a restart."""

    # ---------------------------------------------------------------- operator (no owner check)
    # ---------------------------------------------------------------- views (console, metrics, status line)
    @property
    @abc.abstractmethod
    def data_dir(self) -> Path:
        """The service's data directory (the console keeps its signing key there)."""

    @abc.abstractmethod
    def owner_state(self, owner: str) -> OwnerOverview:
        """What the server holds for `owner` now (no database)."""

    @abc.abstractmethod
    def server_state(self) -> ServerState:
        """What the server holds now, over every owner."""

    @abc.abstractmethod
    def run_facts(self, owner: str, run_ids: Sequence[str]) -> dict[str, RunFacts]:
        """run_id -> its facts, for `owner`'s runs among `run_ids` (NotFoundError for another's)."""

    @abc.abstractmethod
    def session_facts(self, owner: str, session_id: str) -> SessionFacts:
        """The session's facts, of any status; NotFoundError unless it is `owner`'s."""

    @abc.abstractmethod
    def gauges(self) -> ServiceGauges:
        """The gauges `/metrics` reads at scrape time; cheap (no lock held for long, no database)."""

    @abc.abstractmethod
    def checkpoint_bytes(self, owner: str) -> int:
        """Bytes of `owner`'s stored checkpoints that count against its quota (one query)."""

    @abc.abstractmethod
    def future_owner(self, request_id: str) -> str | None:
        """The owner of a future of this server lifetime (None once forgotten); no owner check."""

    @abc.abstractmethod
    def add_future_listener(self, fn: Callable[[FutureState], None]) -> None:
        """Call `fn(final_state)` after every future finishes, on the thread that finished it."""

    @abc.abstractmethod
    def add_weight_sync_listener(self, fn: Callable[[str, float], None]) -> None:
        """Call `fn(mode, seconds)` after every new weight version reaches a sampler ("memory":
        a run's tensors handed over; "files": a checkpoint read from disk)."""

    @abc.abstractmethod
    def operator_view(self, owners: Sequence[str] = ()) -> dict[str, Any]:
        """Every owner's active sessions, runs (loaded or not), checkpoints and per-owner
        totals, JSON-safe. Only for the server's `--admin-api-key`: no owner check."""

    @abc.abstractmethod
    def operator_end_session(self, session_id: str) -> None:
        """End any owner's active session (its runs saved, then unloaded; NotFoundError,
        UserError when it already ended). Only for the operator."""

    @abc.abstractmethod
    def operator_unload_run(self, run_id: str) -> str:
        """Unload any owner's loaded run after saving it; the saved checkpoint's tinker path
        (UserError when it is not loaded). Only for the operator."""

    @abc.abstractmethod
    def export_weights(self, owner: str, run_id: str, name: str = "console-export") -> Submission:
        """Export the owner's loaded run's current weights in Hugging Face format (as
        `save_weights_external`, outside the run's seq_id order: the console's button).
        Future → SaveWeightsExternalResponseInternal; a run not loaded → UserError."""
