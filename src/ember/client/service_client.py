"""`ember.ServiceClient`: the official SDK's ServiceClient, in process, without HTTP.

    import ember
    sc = ember.ServiceClient(models={"Qwen/Qwen3-0.6B": "/models/qwen3-0.6b"}, data_dir="./ember-data")
    tc = sc.create_lora_training_client(base_model="Qwen/Qwen3-0.6B", rank=16).result()

Everything after the constructor is the SDK's API (same method names, arguments, return
types, `tinker.types` data, `tinker.RequestFailedError` for failed requests), so a script
written for `tinker.ServiceClient(base_url=...)` runs here by changing that one line.

Services are shared per database within a process: two ServiceClients on the same data
directory (or database URL) talk to one `ember.service.Service` — which is also what
happens over HTTP, where many clients share one server. They must ask for the same
configuration (every `ServiceConfig` field, workers and sampler; more models may be
registered): a different one is a ValueError naming what differs. The shared service is
closed when its last client closes (or at interpreter exit). Sub-clients get a
`ClientContext`; SDK methods ember lacks raise the SDK's error (`ember.service.unsupported`).

Scale out (the in-process twin of `ember serve --workers.* --parallel.*`): pass
`workers=`, a `ember.service.config.WorkersConfig` or a dict of its fields, and every
training run becomes one engine on a worker group the service owns (closed with it):

    sc = ember.ServiceClient(models={...}, workers={"runtime": "process", "world_size": 2})
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from collections.abc import Callable, Mapping
from typing import Any, Literal

from tinker import types
from tinker.lib.public_interfaces.api_future import APIFuture
from tinker.lib.public_interfaces.custom_loss import LossHandle, trace_loss

from ember.client.context import ClientContext
from ember.client.futures import ClientFuture, chain, completed, unwrap
from ember.client.rest import RestClient
from ember.client.sampling import SamplingClient
from ember.service.unsupported import unsupported
from ember.client.training import TrainingClient
from ember.service.api import ServiceAPI
from ember.service.config import ServiceConfig, WorkersConfig

log = logging.getLogger(__name__)

DEFAULT_DATA_DIR = "~/.ember"
IN_PROCESS_ROOT = "/"  # in process the caller is the operator: any model directory by path
LOCAL_OWNER = "local"

_shared: dict[str, list] = {}  # database url -> [Service, refcount, ServiceConfig, WorkersConfig]
_shared_lock = threading.Lock()


def config_differences(running: ServiceConfig, wanted: ServiceConfig) -> list[str]:
    """The fields of `wanted` that differ from the running service's, as "name=value".

    `models` differ only where both name one model with different directories: the
    registry is additive, so a client may register more models on a shared service."""
    out = []
    for f in dataclasses.fields(ServiceConfig):
        mine, theirs = getattr(running, f.name), getattr(wanted, f.name)
        if f.name == "models":
            clash = {k: v for k, v in theirs.items() if k in mine and mine[k] != v}
            if clash:
                out.append(f"models={clash} (running: { {k: mine[k] for k in clash} })")
        elif f.name == "models_toml":
            continue  # merged into models by ServiceConfig
        elif mine != theirs:
            out.append(f"{f.name}={theirs!r} (running: {mine!r})")
    return out


def _acquire_service(config: ServiceConfig, workers: WorkersConfig | None = None):
    """The process-wide service for config's database; one there must have been started
    with an equal configuration (else ValueError naming what differs)."""
    from ember.service import build_service

    workers = workers or WorkersConfig()
    url = config.resolved_database_url
    with _shared_lock:
        entry = _shared.get(url)
        if entry is None:
            entry = _shared[url] = [build_service(config, workers), 0, config, workers]
        else:
            differences = config_differences(entry[2], config)
            if entry[3] != workers:
                differences.append(f"workers={workers} (running: {entry[3]})")
            if differences:
                raise ValueError(f"the service for {url} already runs with another configuration: "
                                 f"{'; '.join(differences)}. Close its clients first, or use another data_dir")
            entry[0].registry.add_all(config.models)
        entry[1] += 1
        return entry[0], url


def _release_service(url: str) -> None:
    with _shared_lock:
        entry = _shared.get(url)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _shared[url]
            entry[0].close()


@atexit.register
def _close_all() -> None:
    with _shared_lock:
        entries = list(_shared.values())
        _shared.clear()
    for service, *_ in entries:
        service.close()


def _sampler_config(sampler: Any):
    """A SamplerConfig from one, a dict of its fields (unknown keys named), or None."""
    if sampler is None or not isinstance(sampler, dict):
        return sampler
    from ember.config import from_dict
    from ember.sampling.config import SamplerConfig

    return from_dict(SamplerConfig, sampler, prefix="sampler.")


class ServiceClient:
    """In-process counterpart of `tinker.ServiceClient`.

    models: base-model registry {name: local directory} (names as in your scripts, e.g.
        "Qwen/Qwen3-0.6B"); in process, the path of any local model directory also works
        as a name (you are the operator; `ember serve` allows only its `--model-root`s),
        except a directory under the data directory.
    data_dir: checkpoints and the SQLite database (default `$EMBER_DATA_DIR` or ~/.ember,
        your own). One process at a time may use a data directory: it is locked.
    config: a full `ServiceConfig` (then `models`/`data_dir` must be None).
    service: use this service object instead (shared, not closed by this client).
    owner: identity of this client in the service (visibility of runs and checkpoints).
    workers: where training engines run — `WorkersConfig` or a dict of its fields, e.g.
        {"runtime": "process", "world_size": 2, "tp": 2}; None = in process (runtime
        "local"). Clients sharing a service must agree on it.
    sampler: the samplers' settings — `ember.sampling.SamplerConfig` or a dict of its
        fields, e.g. {"backend": "vllm", "max_len": 4096}; None = defaults (TorchSampler
        on the engine's device and dtype).
    The SDK's connection arguments (`base_url`, `api_key`, `project_id`, ...) are accepted
    and ignored, so constructor calls keep working.
    """

    def __init__(
        self,
        models: dict[str, str] | None = None,
        data_dir: str | os.PathLike | None = None,
        config: ServiceConfig | None = None,
        *,
        service: ServiceAPI | None = None,
        owner: str = LOCAL_OWNER,
        workers: WorkersConfig | dict[str, Any] | None = None,
        sampler: Any = None,
        user_metadata: dict[str, str] | None = None,
        project_id: str | None = None,
        display_name: str | None = None,
        **_sdk_kwargs: Any,
    ) -> None:
        if config is not None and (models is not None or data_dir is not None):
            raise ValueError("pass either config or models/data_dir, not both")
        self._owner = owner
        self._user_metadata, self._project_id, self._display_name = user_metadata, project_id, display_name
        self._shared_url: str | None = None
        if isinstance(workers, dict):
            try:
                workers = WorkersConfig(**workers)
            except TypeError as exc:  # an unknown key
                raise ValueError(f"workers: {exc}; known: runtime, world_size, ray_address, dp_replicate, "
                                 "dp_shard, cp, tp, call_timeout_s") from exc
        if service is not None:
            if workers is not None:
                raise ValueError("pass either service or workers, not both (the service has its engines)")
            self._service = service
        else:
            data_dir = data_dir or os.environ.get("EMBER_DATA_DIR") or DEFAULT_DATA_DIR
            if sampler is not None and config is not None:
                raise ValueError("pass the sampler settings inside config (ServiceConfig.sampler), not both")
            # sessions.idle_ttl_s off: a session in this process lives as long as its client
            config = config or ServiceConfig(data_dir=data_dir, models=models or {}, model_roots=[IN_PROCESS_ROOT],
                                             sampler=_sampler_config(sampler), sessions={"idle_ttl_s": None})
            self._service, self._shared_url = _acquire_service(config, workers)
        self._session_id: str | None = None
        self._lock = threading.Lock()
        self._model_seq = 0
        self._sampling_seq = 0
        self._closed = False
        self._stop = threading.Event()
        self._callbacks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ember-client")
        self._tokenizers: dict[str, Any] = {}
        self._context = ClientContext(service=self._service, owner=self._owner, session_id=self._session,
                                      next_sampling_seq=self._next_sampling_seq, callbacks=self._callbacks,
                                      tokenizer=self._tokenizer)

    @property
    def service(self) -> ServiceAPI:
        """The in-process service this client talks to (read-only). Pass it as `service=` to
        another ServiceClient, e.g. with another `owner`, to share one service."""
        return self._service

    @property
    def owner(self) -> str:
        """The caller's identity in the service (read-only; `"local"` unless given)."""
        return self._owner

    @property
    def context(self) -> ClientContext:
        """Read-only: the `ClientContext` (service, owner, session) every sub-client of this
        client works from. ember's own (the SDK's client has none): an in-process caller reaches
        the service and its session through it (e.g. to finish the session)."""
        return self._context

    # ------------------------------------------------------------------ plumbing
    def _session(self) -> str:
        with self._lock:
            if self._closed:
                raise RuntimeError("this ServiceClient is closed")
            if self._session_id is None:
                resp = self._service.create_session(
                    self._owner, tags=[t for t in os.environ.get("TINKER_TAGS", "").split(",") if t],
                    user_metadata=self._user_metadata, project_id=self._project_id, display_name=self._display_name,
                )
                self._session_id = resp.session_id
                sessions = getattr(getattr(self._service, "config", None), "sessions", None)
                timeout = getattr(sessions, "heartbeat_timeout_s", None)
                if timeout:
                    threading.Thread(target=self._heartbeat_loop, args=(resp.session_id, min(10.0, timeout / 3)),
                                     name="ember-heartbeat", daemon=True).start()
            return self._session_id

    def _next_model_seq(self) -> int:
        with self._lock:
            n, self._model_seq = self._model_seq, self._model_seq + 1
            return n

    def _next_sampling_seq(self) -> int:
        with self._lock:
            n, self._sampling_seq = self._sampling_seq, self._sampling_seq + 1
            return n

    def _heartbeat_loop(self, session_id: str, interval: float) -> None:
        """Keep the session alive like the SDK does (only when the service expires sessions)."""
        while not self._stop.wait(interval):
            try:
                self._service.heartbeat(self._owner, session_id)
            except Exception:  # noqa: BLE001 - a finished/expired session ends the loop
                log.warning("heartbeat for session %s failed; stopping heartbeats", session_id)
                return

    def _training_client(self, model_id: str, model_seq_id: int) -> TrainingClient:
        return TrainingClient(self._context, model_id, model_seq_id, self._service.get_info(self._owner, model_id))

    def _tokenizer(self, model_name: str | None, tokenizer_id: str | None):
        """Tokenizers come from the local model directory (never from a hub)."""
        from ember.models import load_tokenizer

        key = tokenizer_id or model_name or ""
        if key not in self._tokenizers:
            directory = tokenizer_id
            if directory is None or not Path(directory).is_dir():
                directory = self._service.registry.resolve(model_name).directory
            self._tokenizers[key] = load_tokenizer(directory)
        return self._tokenizers[key]

    # ------------------------------------------------------------------ training clients
    def create_lora_training_client(
        self, base_model: str, rank: int = 32, seed: int | None = None, train_mlp: bool = True,
        train_attn: bool = True, train_unembed: bool = True, user_metadata: dict[str, str] | None = None,
        optimizer: types.OptimizerConfig | None = None,
    ) -> ClientFuture[TrainingClient]:
        assert any([train_mlp, train_attn, train_unembed]), (
            "At least one of train_mlp, train_attn, or train_unembed must be True"
        )
        lora = types.LoraConfig(rank=rank, seed=seed, train_mlp=train_mlp, train_attn=train_attn,
                                train_unembed=train_unembed)
        return self._create(base_model, lora, user_metadata, optimizer)

    def create_full_training_client(
        self, base_model: str, user_metadata: dict[str, str] | None = None,
    ) -> ClientFuture[TrainingClient]:
        """ember extension: full fine-tuning of a private copy of the base model."""
        return self._create(base_model, None, user_metadata, None)

    def _create(self, base_model, lora, user_metadata, optimizer) -> ClientFuture[TrainingClient]:
        session_id, seq = self._session(), self._next_model_seq()
        opt = optimizer.model_dump() if optimizer is not None else None
        sub = self._service.create_model(self._owner, session_id, seq, base_model, lora,
                                         optimizer_config=opt, user_metadata=user_metadata)
        return ClientFuture(chain(self._context.watch(sub.request_id),
                                  lambda st: self._training_client(unwrap(st).model_id, seq)))

    async def create_lora_training_client_async(self, base_model: str, rank: int = 32, seed: int | None = None,
                                                train_mlp: bool = True, train_attn: bool = True,
                                                train_unembed: bool = True, user_metadata=None,
                                                optimizer=None) -> TrainingClient:
        return await self.create_lora_training_client(base_model, rank, seed, train_mlp, train_attn, train_unembed,
                                                      user_metadata, optimizer)

    def _from_state(self, path: str, optimizer: bool, base_model: str | None, user_metadata,
                    optimizer_config: types.OptimizerConfig | None = None,
                    weights_access_token: str | None = None) -> ClientFuture[TrainingClient]:
        session_id, seq = self._session(), self._next_model_seq()
        opt = optimizer_config.model_dump(mode="json") if optimizer_config is not None else None
        sub = self._service.load_weights(self._owner, path, optimizer, session_id=session_id, model_seq_id=seq,
                                         base_model=base_model, user_metadata=user_metadata, optimizer_config=opt,
                                         weights_access_token=weights_access_token)
        model_id = f"{session_id}:train:{seq}"
        return ClientFuture(chain(self._context.watch(sub.request_id),
                                  lambda st: (unwrap(st), self._training_client(model_id, seq))[1]))

    def create_training_client_from_state(self, path: str, base_model: str | None = None,
                                          user_metadata: dict[str, str] | None = None,
                                          weights_access_token: str | None = None,
                                          optimizer: types.OptimizerConfig | None = None) -> ClientFuture[TrainingClient]:
        return self._from_state(path, False, base_model, user_metadata, optimizer, weights_access_token)

    async def create_training_client_from_state_async(self, path: str, base_model=None, user_metadata=None,
                                                      weights_access_token=None, optimizer=None) -> TrainingClient:
        return await self.create_training_client_from_state(path, base_model, user_metadata, weights_access_token,
                                                            optimizer=optimizer)

    def create_training_client_from_state_with_optimizer(self, path: str, base_model: str | None = None,
                                                         user_metadata: dict[str, str] | None = None,
                                                         weights_access_token: str | None = None) -> ClientFuture[TrainingClient]:
        return self._from_state(path, True, base_model, user_metadata, weights_access_token=weights_access_token)

    async def create_training_client_from_state_with_optimizer_async(self, path: str, base_model=None,
                                                                     user_metadata=None,
                                                                     weights_access_token=None) -> TrainingClient:
        return await self.create_training_client_from_state_with_optimizer(path, base_model, user_metadata,
                                                                           weights_access_token)

    # ------------------------------------------------------------------ sampling clients
    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               retry_config: Any = None, record_stability_info: bool = False) -> ClientFuture[SamplingClient]:
        if model_path is None and base_model is None:
            raise ValueError("Either model_path or base_model must be provided")
        if model_path is not None and not model_path.startswith("tinker://"):
            raise ValueError(f"model_path must start with 'tinker://', got {model_path!r}")
        session_id, seq = self._session(), self._next_sampling_seq()

        def create() -> SamplingClient:
            resp = self._service.create_sampling_session(
                self._owner, session_id, seq, base_model=None if model_path else base_model, model_path=model_path)
            return self._context.sampling_client(resp.sampling_session_id, None if model_path else base_model,
                                                 record_stability_info)

        return ClientFuture(self._callbacks.submit(create))

    async def create_sampling_client_async(self, model_path=None, base_model=None, retry_config=None,
                                           record_stability_info=False) -> SamplingClient:
        return await self.create_sampling_client(model_path, base_model, retry_config, record_stability_info)

    # ------------------------------------------------------------------ misc
    def get_server_capabilities(self) -> types.GetServerCapabilitiesResponse:
        return self._service.get_server_capabilities()

    async def get_server_capabilities_async(self) -> types.GetServerCapabilitiesResponse:
        return self._service.get_server_capabilities()

    def create_custom_loss(self, fn: Callable, input_ranks: Mapping[str, types.CustomLossInputRank]) -> APIFuture[LossHandle]:
        """The SDK's `create_custom_loss`: `fn` is traced and checked here (the SDK's own
        `trace_loss`) and runs client-side in `TrainingClient.forward_backward_custom`, as
        over HTTP, where ember serve does not take uploaded losses."""
        return completed(trace_loss(fn, input_ranks, self._session()))

    def get_telemetry(self) -> None:
        """None: in process there is no SDK telemetry to report."""
        return None

    copy_weights = unsupported("copy_weights")
    get_console_url = unsupported("get_console_url")
    holder = property(unsupported("holder"))

    def create_rest_client(self) -> RestClient:
        return RestClient(self._context)

    def close(self, status: Literal["success", "errored", "interrupted"],
              detail: str | None = None) -> APIFuture[None]:
        with self._lock:
            if self._closed:
                return completed(None)
            self._closed = True
            session_id = self._session_id
        self._stop.set()
        try:
            if session_id is not None:
                self._service.finish_session(self._owner, session_id, status, detail)
        finally:
            self._callbacks.shutdown(wait=False)
            if self._shared_url is not None:
                _release_service(self._shared_url)
        return completed(None)

    def __enter__(self) -> "ServiceClient":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("success" if exc_type is None else "errored")
