"""In-process `SamplingClient`: the SDK's SamplingClient methods over an `ember.service`."""

from __future__ import annotations

import dataclasses
import itertools
import threading
from concurrent.futures import Future as ConcurrentFuture
from typing import TYPE_CHECKING

from tinker import types
from tinker.lib.public_interfaces.api_future import APIFuture, AwaitableConcurrentFuture

from ember.client.context import retry_busy
from ember.client.futures import chain, unwrap
from ember.service.api import NotFoundError
from ember.service.unsupported import unsupported

if TYPE_CHECKING:
    from ember.client.context import ClientContext


def _with_sequence_ids(response: types.SampleResponse, ids: list[str] | None) -> types.SampleResponse:
    """Stamp the submission's sample_sequence_ids on the sequences, as the SDK does."""
    if not ids or len(ids) != len(response.sequences):
        return response
    if all(s.sequence_id == i for s, i in zip(response.sequences, ids)):
        return response
    seqs = [dataclasses.replace(s, sequence_id=i) for s, i in zip(response.sequences, ids, strict=True)]
    return dataclasses.replace(response, sequences=seqs)


def _check_prompt_extras(target: types.TensorData | None, alt_k: int) -> None:
    """The SDK's own client-side checks (ValueError before sending), so that in process a
    call fails where it fails over HTTP; the rest is the sampler's to refuse."""
    if target is not None:
        if getattr(target, "dtype", None) != "int64":
            raise ValueError(f"target_prompt_logprobs must be an int64 tensor of token ids, "
                             f"got {getattr(target, 'dtype', type(target).__name__)}")
        if target.shape is None or len(target.shape) != 2:
            raise ValueError(f"target_prompt_logprobs must be 2-D, [len(prompt) - 1, K], got shape {target.shape}")
    if alt_k < 0:
        raise ValueError(f"prompt_alt_tokens_k must be 0 or greater, got {alt_k}")


class SamplingClient:
    """Same methods, arguments and return types as `tinker.SamplingClient`."""

    def __init__(self, context: "ClientContext", sampling_session_id: str, base_model: str,
                 record_stability_info: bool = False) -> None:
        self._ctx = context
        self._record_stability_info = bool(record_stability_info)
        self._sampling_session_id = sampling_session_id
        self._base_model = base_model
        self._seq = itertools.count(0)
        self._seq_lock = threading.Lock()

    @property
    def context(self) -> "ClientContext":
        """Read-only: the `ClientContext` (service, owner, session) this client works from,
        the one its `ServiceClient` made. ember's own (the SDK's client has none): an in-process
        caller reaches the service and its session through it."""
        return self._ctx

    def _next_seq(self) -> int:
        with self._seq_lock:
            return next(self._seq)

    def sample(
        self,
        prompt: types.ModelInput,
        num_samples: int,
        sampling_params: types.SamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: types.TensorData | None = None,
        prompt_alt_tokens_k: int = 0,
        prompt_logprobs_last_n: int | None = None,
    ) -> APIFuture[types.SampleResponse]:
        _check_prompt_extras(target_prompt_logprobs, prompt_alt_tokens_k)
        if prompt_logprobs_last_n is not None and not include_prompt_logprobs:
            raise ValueError("prompt_logprobs_last_n requires include_prompt_logprobs=True")
        try:
            seq_id = self._next_seq()
            sub = retry_busy(lambda: self._ctx.service.sample(
                self._ctx.owner, self._sampling_session_id, seq_id, prompt, num_samples, sampling_params,
                include_prompt_logprobs=include_prompt_logprobs, topk_prompt_logprobs=topk_prompt_logprobs,
                topk_sample_logprobs=topk_sample_logprobs, prompt_logprobs_last_n=prompt_logprobs_last_n,
                target_prompt_logprobs=target_prompt_logprobs, prompt_alt_tokens_k=prompt_alt_tokens_k,
                record_stability_info=self._record_stability_info,
            ))
        except NotFoundError as exc:  # e.g. its checkpoint was unpublished: raised by .result(), as over HTTP
            failed: ConcurrentFuture = ConcurrentFuture()
            failed.set_exception(exc)
            return AwaitableConcurrentFuture(failed)
        ids = sub.sample_sequence_ids
        state = self._ctx.watch(sub.request_id)
        return AwaitableConcurrentFuture(chain(state, lambda st: _with_sequence_ids(unwrap(st), ids)))

    async def sample_async(self, prompt, num_samples, sampling_params, include_prompt_logprobs=False,
                           topk_prompt_logprobs=0, topk_sample_logprobs=0, target_prompt_logprobs=None,
                           prompt_alt_tokens_k=0, prompt_logprobs_last_n=None) -> types.SampleResponse:
        return await self.sample(prompt, num_samples, sampling_params, include_prompt_logprobs, topk_prompt_logprobs,
                                 topk_sample_logprobs, target_prompt_logprobs, prompt_alt_tokens_k,
                                 prompt_logprobs_last_n)

    def compute_logprobs(self, prompt: types.ModelInput,
                         prompt_logprobs_last_n: int | None = None) -> APIFuture[list[float | None]]:
        """As in the SDK: a one-token sample with prompt logprobs; None at position 0."""
        fut = self.sample(prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                          prompt_logprobs_last_n=prompt_logprobs_last_n)
        return AwaitableConcurrentFuture(chain(fut.future(), lambda r: r.prompt_logprobs))

    async def compute_logprobs_async(self, prompt: types.ModelInput,
                                     prompt_logprobs_last_n: int | None = None) -> list[float | None]:
        return await self.compute_logprobs(prompt, prompt_logprobs_last_n)

    def get_tokenizer(self):
        return self._ctx.tokenizer(self._base_model, None)

    def get_base_model(self) -> str:
        return self._base_model

    async def get_base_model_async(self) -> str:
        return self._base_model

    def get_sampler_handle(self) -> str:
        return self._sampling_session_id

    def get_telemetry(self) -> None:
        """None: in process there is no SDK telemetry to report."""
        return None

    def on_queue_state_change(self, queue_state, queue_state_reason: str | None) -> None:
        """The SDK's hook for server queue states; an in-process service reports none."""

    create = staticmethod(unsupported("create"))
    from_sampler_handle = staticmethod(unsupported("from_sampler_handle"))

    def __repr__(self) -> str:
        return f"SamplingClient(sampling_session_id={self._sampling_session_id!r}, base_model={self._base_model!r})"
