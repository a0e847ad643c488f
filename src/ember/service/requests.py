"""Typed requests: one frozen dataclass per `ServiceAPI` call whose arguments travel from
the HTTP route through `Service` to a manager, written once here instead of at each step.

The server's routes build one from the parsed wire type; `ServiceAPI.submit` (and
`open_session`) take it; `Service` and its managers (`RunManager.create_model`,
`RunManager.create_from_checkpoint`, `SamplerManager.sample`) read its fields. The
keyword methods of `ServiceAPI` (`sample`, `forward_backward`, ...) build the same object
from their arguments, so in-process callers and the server go one way.

Field checks that belong to a request alone (which addressing mode, which kind) are its
methods and raise `UserError` naming the field; the service decides how the error is
reported (a failed future for a submission, docs/protocol.md §2). Fields are the wire's
names and meanings (docs/protocol.md); their order is the old keyword signatures' order,
so positional calls keep working.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from tinker import types

from ember.errors import UserError

if TYPE_CHECKING:  # the sampling package imports torch: not at this module's import
    from ember.sampling.base import TokenCallback

__all__ = [
    "CreateModelRequest", "CreateSessionRequest", "ForwardBackwardRequest", "LoadWeightsRequest",
    "OptimStepRequest", "SampleRequest", "SaveWeightsForSamplerRequest", "SaveWeightsRequest", "SubmitRequest",
]


@dataclass(frozen=True)
class CreateSessionRequest:
    """Open a session (one per ServiceClient)."""

    _: KW_ONLY
    tags: Sequence[str] = ()
    user_metadata: Mapping[str, Any] | None = None
    project_id: str | None = None
    display_name: str | None = None
    sdk_version: str | None = None


@dataclass(frozen=True)
class CreateModelRequest:
    """A training run f"{session_id}:train:{model_seq_id}"; `lora_config` None is full fine-tuning."""

    session_id: str
    model_seq_id: int
    base_model: str
    lora_config: types.LoraConfig | None
    _: KW_ONLY
    optimizer_config: Mapping[str, Any] | None = None
    user_metadata: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class LoadWeightsRequest:
    """Load a training checkpoint into run `model_id` (at `seq_id`), or create a run from it
    (`session_id` + `model_seq_id`, the create-via-load)."""

    path: str
    optimizer: bool
    _: KW_ONLY
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: Mapping[str, Any] | None = None
    optimizer_config: Mapping[str, Any] | None = None
    weights_access_token: str | None = None

    @property
    def creates_run(self) -> bool:
        return self.session_id is not None

    def check_addressing(self) -> None:
        if (self.model_id is not None) == (self.session_id is not None):
            raise UserError("load_weights needs either model_id+seq_id or session_id+model_seq_id "
                            "(exactly one of the two)")


@dataclass(frozen=True)
class ForwardBackwardRequest:
    """An ordered forward_backward (or forward, `forward_only`) of run `model_id`."""

    model_id: str
    seq_id: int
    data: Sequence[types.Datum]
    loss_fn: str
    loss_fn_config: Mapping[str, float | str] | None = None
    _: KW_ONLY
    forward_only: bool = False

    @property
    def request_type(self) -> Literal["Forward", "ForwardBackward"]:
        return "Forward" if self.forward_only else "ForwardBackward"


@dataclass(frozen=True)
class OptimStepRequest:
    """An ordered optimizer step of run `model_id` with the run's optimizer's parameters."""

    model_id: str
    seq_id: int
    adam_params: types.AdamParams | Any  # or another optimizer's parameters (`ember.engine.optimizers`)


@dataclass(frozen=True)
class SaveWeightsRequest:
    """An ordered save of weights + optimizer state as the checkpoint named `path`."""

    model_id: str
    seq_id: int
    path: str
    _: KW_ONLY
    overwrite: bool = False
    ttl_seconds: int | None = None
    user_metadata: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class SaveWeightsForSamplerRequest:
    """Sampler weights of run `model_id`: a named export (`path`) or a new sampling session
    (`sampling_session_seq_id`); `seq_id` None is unordered."""

    model_id: str
    seq_id: int | None
    path: str | None = None
    _: KW_ONLY
    sampling_session_seq_id: int | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    ttl_seconds: int | None = None
    user_metadata: Mapping[str, Any] | None = None

    def check_target(self) -> None:
        if (self.path is None) == (self.sampling_session_seq_id is None):
            raise UserError("save_weights_for_sampler needs exactly one of path (a name) and sampling_session_seq_id")

    def check_kind(self) -> None:
        if self.kind not in ("snapshot", "inflight") or (self.kind == "inflight" and self.path is not None):
            raise UserError(
                "save_weights_for_sampler: kind must be 'snapshot' or 'inflight', and 'inflight' only without a "
                f"path (save_weights_and_get_sampling_client); got kind={self.kind!r}"
                + (f" with path {self.path!r}" if self.path is not None else ""))


@dataclass(frozen=True)
class SampleRequest:
    """A sample (or compute_logprobs: one token with `include_prompt_logprobs`) from sampling
    session `sampling_session_id`; `seq_id` None is not deduplicated."""

    sampling_session_id: str
    seq_id: int | None
    prompt: types.ModelInput
    num_samples: int
    sampling_params: types.SamplingParams
    _: KW_ONLY
    include_prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None
    target_prompt_logprobs: types.TensorData | None = None
    prompt_alt_tokens_k: int = 0
    record_stability_info: bool = False
    on_tokens: TokenCallback | None = field(default=None, compare=False)

    def sampler_arguments(self) -> dict[str, Any]:
        """What a sampler backend's `SamplingRequest` takes of this request."""
        out: dict[str, Any] = dict(
            prompt=self.prompt, num_samples=self.num_samples,
            sampling_params=self.sampling_params, include_prompt_logprobs=bool(self.include_prompt_logprobs),
            topk_prompt_logprobs=self.topk_prompt_logprobs, topk_sample_logprobs=self.topk_sample_logprobs,
            prompt_logprobs_last_n=self.prompt_logprobs_last_n, target_prompt_logprobs=self.target_prompt_logprobs,
            prompt_alt_tokens_k=self.prompt_alt_tokens_k)
        if self.on_tokens is not None:
            out["on_tokens"] = self.on_tokens
        return out


# What `ServiceAPI.submit` takes: every call that answers a future.
SubmitRequest = (CreateModelRequest | LoadWeightsRequest | ForwardBackwardRequest | OptimStepRequest
                 | SaveWeightsRequest | SaveWeightsForSamplerRequest | SampleRequest)
