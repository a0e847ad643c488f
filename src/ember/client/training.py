"""In-process `TrainingClient`: the SDK's TrainingClient methods over an `ember.service`.

Every training call reserves the next `seq_id` (shared by all call types, starting at 1,
as in the SDK) and is *submitted* to the service in seq_id order. Normally a call is
submitted at once; `forward_backward_custom` reserves two seq_ids and submits the second
(the backward pass with weights = -dC/dlogprobs) only when the user's loss has been
evaluated on the forward result, so calls made meanwhile wait here, not in the service
(whose gap timeout would otherwise skip the reserved seq_id). If a custom loss fails, the
client is poisoned like the SDK's: queued and later training calls fail with that error.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future as ConcurrentFuture
from typing import TYPE_CHECKING, Any, List, Literal

import torch
from tinker import types
from tinker.lib.public_interfaces.api_future import APIFuture, AwaitableConcurrentFuture
from tinker.lib.public_interfaces.custom_loss import LossHandle

from ember.client.context import ClientContext, retry_busy
from ember.client.futures import ClientFuture, chain, unwrap
from ember.engine.optimizers import params_types
from ember.service.unsupported import unsupported

if TYPE_CHECKING:
    from ember.client.sampling import SamplingClient

log = logging.getLogger(__name__)

LOAD_STATE_DEPRECATION = (
    "DEPRECATED: TrainingClient.load_state*() is deprecated and will NOT be supported in future tinker SDK "
    "versions. Create a new training client from the checkpoint with "
    "ServiceClient.create_training_client_from_state[_with_optimizer]() instead."
)

Submit = Callable[[int], Any]  # seq_id -> service Submission


class OrderedSubmitter:
    """Reserves seq_ids and submits requests to the service strictly in seq_id order."""

    def __init__(self, first_seq: int) -> None:
        self._reserved = first_seq
        self._next = first_seq
        self._pending: dict[int, tuple[Submit, ConcurrentFuture]] = {}
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def reserve(self, count: int = 1) -> range:
        with self._lock:
            start = self._reserved
            self._reserved += count
            return range(start, self._reserved)

    def fulfil(self, seq_id: int, submit: Submit) -> ConcurrentFuture:
        """Submit at seq_id's turn; the future resolves to the service `Submission`."""
        out: ConcurrentFuture = ConcurrentFuture()
        with self._lock:
            self._pending[seq_id] = (submit, out)
        self._drain()
        return out

    def poison(self, exc: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = exc
        self._drain()

    def _drain(self) -> None:
        while True:
            with self._lock:
                if self._error is not None:
                    doomed, self._pending, err = list(self._pending.values()), {}, self._error
                    break
                seq = self._next
                item = self._pending.pop(seq, None)
                if item is None:
                    return
                self._next += 1
            submit, out = item
            try:
                out.set_result(submit(seq))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
                out.set_exception(exc)
        for _, out in doomed:
            out.set_exception(RuntimeError(f"an earlier custom-loss request of this training client failed: {err!r}"))


class TrainingClient:
    """Same methods, arguments and return types as `tinker.TrainingClient`."""

    def __init__(self, context: ClientContext, model_id: str, model_seq_id: int, info: types.GetInfoResponse) -> None:
        self._ctx = context
        self.model_id = model_id
        self._training_client_id = model_seq_id
        self._info = info
        self._submitter = OrderedSubmitter(first_seq=1)

    @property
    def context(self) -> ClientContext:
        """Read-only: the `ClientContext` (service, owner, session) this client works from,
        the one its `ServiceClient` made. ember's own (the SDK's client has none): an in-process
        caller reaches the service and its session through it."""
        return self._ctx

    # ------------------------------------------------------------------ plumbing
    @property
    def _service(self):
        return self._ctx.service

    def _call(self, submit: Callable[[int], Any], transform: Callable[[Any], Any] = lambda r: r,
              seq_id: int | None = None) -> APIFuture:
        seq = self._submitter.reserve(1)[0] if seq_id is None else seq_id
        submitted = self._submitter.fulfil(seq, submit)
        state = _flat_chain(submitted, lambda sub: self._ctx.watch(sub.request_id))
        return AwaitableConcurrentFuture(chain(state, lambda st: transform(unwrap(st))))

    # ------------------------------------------------------------------ forward / backward
    def forward(self, data: List[types.Datum], loss_fn: types.LossFnType,
                loss_fn_config: Mapping[str, float | str] | None = None) -> APIFuture[types.ForwardBackwardOutput]:
        return self._fwd_bwd(data, loss_fn, loss_fn_config, forward_only=True)

    def forward_backward(self, data: List[types.Datum], loss_fn: types.LossFnType,
                         loss_fn_config: Mapping[str, float | str] | None = None) -> APIFuture[types.ForwardBackwardOutput]:
        return self._fwd_bwd(data, loss_fn, loss_fn_config, forward_only=False)

    def _fwd_bwd(self, data, loss_fn, loss_fn_config, *, forward_only: bool, seq_id: int | None = None) -> APIFuture:
        data = list(data)
        if not data:
            raise ValueError("No data provided")
        owner = self._ctx.owner
        return self._call(
            lambda s: retry_busy(lambda: self._service.forward_backward(owner, self.model_id, s, data, loss_fn,
                                                                        loss_fn_config, forward_only=forward_only)),
            seq_id=seq_id,
        )

    async def forward_async(self, data, loss_fn, loss_fn_config=None) -> APIFuture[types.ForwardBackwardOutput]:
        return self.forward(data, loss_fn, loss_fn_config)

    async def forward_backward_async(self, data, loss_fn, loss_fn_config=None) -> APIFuture[types.ForwardBackwardOutput]:
        return self.forward_backward(data, loss_fn, loss_fn_config)

    def forward_backward_custom(self, data: List[types.Datum], loss_fn: Callable | LossHandle, *,
                                loss_type_input: Literal["logprobs"] | None = None) -> APIFuture[types.ForwardBackwardOutput]:
        """The SDK's client-side custom loss: forward (CE, forward_only) → user loss on the
        logprobs → backward as CE with weights = -dC/dlogprobs. Metrics: `loss:sum` is the
        custom loss, `surrogate_loss:sum` the server's CE sum, plus the user's metrics."""
        from ember.client.custom_loss import backward_data, check_loss_handle, custom_forward_data, evaluate_custom_loss

        data = list(data)
        if isinstance(loss_fn, LossHandle):
            check_loss_handle(loss_fn, data, self._ctx.session_id())
        fwd_data = custom_forward_data(data)
        fwd_seq, bwd_seq = self._submitter.reserve(2)
        forward = self._fwd_bwd(fwd_data, "cross_entropy", None, forward_only=True, seq_id=fwd_seq)
        out: ConcurrentFuture = ConcurrentFuture()

        def after_forward(f: ConcurrentFuture) -> None:
            try:
                loss_sum, metrics, grads = evaluate_custom_loss(data, loss_fn, f.result())
                bwd = self._fwd_bwd(backward_data(data, grads), "cross_entropy", None, forward_only=False, seq_id=bwd_seq)
            except BaseException as exc:  # noqa: BLE001 - poisons the client like the SDK
                self._submitter.poison(exc)
                out.set_exception(exc)
                return
            final = chain(bwd.future(), lambda res: _merge_custom_metrics(res, loss_sum, metrics))
            final.add_done_callback(lambda g: _copy_outcome(g, out))

        # The user's loss runs on the client's callback thread, not on the service's lane.
        forward.future().add_done_callback(lambda f: self._ctx.callbacks.submit(after_forward, f))
        return AwaitableConcurrentFuture(out)

    async def forward_backward_custom_async(self, data, loss_fn, *, loss_type_input=None) -> APIFuture:
        return self.forward_backward_custom(data, loss_fn, loss_type_input=loss_type_input)

    # ------------------------------------------------------------------ optimizer
    def optim_step(self, optim_params: types.AdamParams | types.DimuonParams | None = None, *,
                   adam_params: types.AdamParams | None = None) -> APIFuture[types.OptimStepResponse]:
        if optim_params is not None and adam_params is not None:
            raise ValueError("Specify optim_params or legacy adam_params, not both")
        params = optim_params if optim_params is not None else adam_params
        if not isinstance(params, params_types()):
            raise TypeError(f"optim_params: expected {' or '.join(t.__name__ for t in params_types())}, "
                            f"got {type(params).__name__}")
        owner = self._ctx.owner
        return self._call(lambda s: self._service.optim_step(owner, self.model_id, s, params))

    async def optim_step_async(self, optim_params=None, *, adam_params=None) -> APIFuture[types.OptimStepResponse]:
        return self.optim_step(optim_params, adam_params=adam_params)

    # ------------------------------------------------------------------ state
    def save_state(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                   user_metadata: dict[str, str] | None = None) -> APIFuture[types.SaveWeightsResponse]:
        owner = self._ctx.owner
        return self._call(lambda s: self._service.save_weights(
            owner, self.model_id, s, name, overwrite=overwrite, ttl_seconds=ttl_seconds, user_metadata=user_metadata))

    async def save_state_async(self, name, ttl_seconds=None, overwrite=False, user_metadata=None) -> APIFuture:
        return self.save_state(name, ttl_seconds=ttl_seconds, overwrite=overwrite, user_metadata=user_metadata)

    def _load(self, path: str, optimizer: bool, token: str | None) -> APIFuture[types.LoadWeightsResponse]:
        log.error(LOAD_STATE_DEPRECATION)
        owner = self._ctx.owner
        return self._call(lambda s: self._service.load_weights(owner, path, optimizer, model_id=self.model_id, seq_id=s,
                                                               weights_access_token=token))

    def load_state(self, path: str, weights_access_token: str | None = None) -> APIFuture[types.LoadWeightsResponse]:
        return self._load(path, optimizer=False, token=weights_access_token)

    async def load_state_async(self, path: str, weights_access_token: str | None = None) -> APIFuture:
        return self.load_state(path, weights_access_token)

    def load_state_with_optimizer(self, path: str, weights_access_token: str | None = None) -> APIFuture[types.LoadWeightsResponse]:
        return self._load(path, optimizer=True, token=weights_access_token)

    async def load_state_with_optimizer_async(self, path: str, weights_access_token: str | None = None) -> APIFuture:
        return self.load_state_with_optimizer(path, weights_access_token)

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None,
                                 user_metadata: dict[str, str] | None = None) -> APIFuture[types.SaveWeightsForSamplerResponse]:
        owner = self._ctx.owner
        return self._call(
            lambda s: self._service.save_weights_for_sampler(
                owner, self.model_id, s, name, ttl_seconds=ttl_seconds, user_metadata=user_metadata),
            lambda r: types.SaveWeightsForSamplerResponse(path=r.path),
        )

    async def save_weights_for_sampler_async(self, name, ttl_seconds=None, user_metadata=None) -> APIFuture:
        return self.save_weights_for_sampler(name, ttl_seconds=ttl_seconds, user_metadata=user_metadata)

    def save_weights_external(self, name: str, ttl_seconds: int | None = None,
                              age_encryption_recipients: list[str] | None = None) -> APIFuture[types.SaveWeightsExternalResponse]:
        owner = self._ctx.owner
        return self._call(
            lambda s: self._service.save_weights_external(
                owner, self.model_id, s, name, ttl_seconds=ttl_seconds, age_encryption_recipients=age_encryption_recipients),
            lambda r: types.SaveWeightsExternalResponse(path=r.path),
        )

    async def save_weights_external_async(self, name, ttl_seconds=None, age_encryption_recipients=None) -> APIFuture:
        return self.save_weights_external(name, ttl_seconds=ttl_seconds, age_encryption_recipients=age_encryption_recipients)

    def save_weights_and_get_sampling_client(self, name: str | None = None, retry_config: Any = None,
                                             record_stability_info: bool = False,
                                             kind: types.SamplingClientKind = "snapshot") -> ClientFuture["SamplingClient"]:
        owner = self._ctx.owner
        sampling_seq = self._ctx.next_sampling_seq()
        base = self._info.model_data.model_name
        fut = self._call(
            lambda s: self._service.save_weights_for_sampler(
                owner, self.model_id, s, None, sampling_session_seq_id=sampling_seq, kind=kind),
            lambda r: self._ctx.sampling_client(r.sampling_session_id, base, record_stability_info),
        )
        return ClientFuture(fut.future())

    async def save_weights_and_get_sampling_client_async(self, name=None, retry_config=None,
                                                         record_stability_info=False, kind="snapshot") -> "SamplingClient":
        return await self.save_weights_and_get_sampling_client(name, retry_config, record_stability_info, kind)

    def create_sampling_client(self, model_path: str, retry_config: Any = None,
                               record_stability_info: bool = False) -> ClientFuture["SamplingClient"]:
        if not model_path.startswith("tinker://"):
            raise ValueError(f"model_path must start with 'tinker://', got {model_path!r}")

        def create() -> "SamplingClient":
            resp = self._service.create_sampling_session(self._ctx.owner, self._ctx.session_id(),
                                                         self._ctx.next_sampling_seq(), model_path=model_path)
            return self._ctx.sampling_client(resp.sampling_session_id, None, record_stability_info)

        return ClientFuture(self._ctx.callbacks.submit(create))

    async def create_sampling_client_async(self, model_path: str, retry_config=None,
                                           record_stability_info=False) -> "SamplingClient":
        return await self.create_sampling_client(model_path, retry_config, record_stability_info)

    # ------------------------------------------------------------------ info
    def get_info(self) -> types.GetInfoResponse:
        return self._info

    async def get_info_async(self) -> types.GetInfoResponse:
        return self._info

    def get_tokenizer(self):
        return self._ctx.tokenizer(self._info.model_data.model_name, self._info.model_data.tokenizer_id)

    def get_telemetry(self) -> None:
        """None: in process there is no SDK telemetry to report."""
        return None

    get_console_url = unsupported("get_console_url")

    def __repr__(self) -> str:
        return f"TrainingClient(model_id={self.model_id!r})"


def _flat_chain(src: ConcurrentFuture, fn: Callable[[Any], ConcurrentFuture]) -> ConcurrentFuture:
    """A future of the future returned by fn(src.result())."""
    out: ConcurrentFuture = ConcurrentFuture()

    def first(f: ConcurrentFuture) -> None:
        try:
            inner = fn(f.result())
        except BaseException as exc:  # noqa: BLE001
            out.set_exception(exc)
            return
        inner.add_done_callback(lambda g: _copy_outcome(g, out))

    src.add_done_callback(first)
    return out


def _copy_outcome(src: ConcurrentFuture, dst: ConcurrentFuture) -> None:
    if dst.done():
        return
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())


def _merge_custom_metrics(result: types.ForwardBackwardOutput, loss_sum: float,
                          metrics: Mapping[str, float]) -> types.ForwardBackwardOutput:
    surrogate = result.metrics.pop("loss:sum")
    result.metrics.update({k: float(v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()})
    result.metrics["loss:sum"] = loss_sum
    result.metrics["surrogate_loss:sum"] = surrogate
    return result
