"""The `Sampler` interface: what the service asks of a sampling backend.

A sampler serves one base model. Weights reach it as *versions*: `load_weights` turns
an engine's `named_weights()` into an immutable `WeightVersion` (docs/architecture.md contract 4),
and every request names the version it samples from (`None` = the base model's own
weights). A handle pinned to version v samples from v forever, however many newer
versions appear; a version's memory is released when nothing references it any more.

Requests and responses are the `tinker` SDK's types (`types.ModelInput`,
`types.SamplingParams`, `types.SampleResponse`), so the service passes them through
from the wire. The semantics are Tinker's (docs/protocol.md §4.6, §4.7):

* `max_tokens`: the most tokens to generate; unset → the backend's documented default
  (`SamplerConfig.default_max_tokens`, 128 for TorchSampler). A sequence that reaches it
  ends with `stop_reason="length"`.
* `temperature` (0 → greedy argmax), `top_k` (-1 = off, else >= 1; applied first),
  `top_p` in (0, 1] (nucleus of the top-k-renormalised distribution).
* `seed`: same seed + same weights + same request → the same tokens, whatever else is in
  the batch (randomness is a pure function of (seed, sample index, step), never a global
  RNG). Sample i of a request differs from sample j. No seed → fresh OS entropy.
* `stop`: `None` → stop at the tokenizer's EOS; `[]` → no stop at all, not even EOS
  (generate to max_tokens); a string or list of strings → stop as soon as the decoded
  completion contains one of them (EOS still stops); a list of ints → stop token ids
  (EOS still stops). The token that ended the sequence is included in `tokens` (for a
  string: every token up to and including the one that completed it) and
  `stop_reason="stop"`.
* `logprobs` of each sampled token, from the model's raw distribution (softmax of the
  logits, before temperature/top-k/top-p), which is what the trainer's `forward`
  computes (contract 5). `logprobs_mode="processed"` returns the logprobs of the
  distribution actually sampled from instead (for exact importance weights).
* `include_prompt_logprobs`: `prompt_logprobs[0]` is None (NaN in `prompt_logprobs_np`),
  then logp(prompt[i] | prompt[:i]); `topk_prompt_logprobs=k`: k (token, logprob) pairs
  per prompt position (None at position 0); `topk_sample_logprobs=k` fills each
  sequence's `topk_logprobs`; `prompt_logprobs_last_n=n` scores only the last n prompt
  positions (earlier entries None; n >= len(prompt) - 1 scores them all). Counts larger
  than meaningful are clamped before anything is allocated: top-k counts to the
  vocabulary, `prompt_logprobs_last_n` to the prompt.
* `target_prompt_logprobs`: an int64 `[len(prompt) - 1, K]` tensor (dense or sparse CSR)
  of token ids; the response's `target_prompt_logprobs` has the same shape and layout,
  holding logp(id | prompt[:i + 1]) (raw, as `prompt_logprobs`) at cell [i, j], 0.0 where
  the request had -1. `prompt_alt_tokens_k=k`: k draws with replacement from the
  next-token distribution at the request's temperature (0 → the argmax k times; top-k /
  top-p do not apply) at every prompt position after the first, with their raw
  logprobs; seeded requests draw the same tokens. k is at most
  `params.MAX_PROMPT_ALT_TOKENS_K` (draws with replacement: k is not clamped to the
  vocabulary, it is refused above that limit). `prompt_logprobs_last_n` does not apply to
  either.
* `prompt_cache_hit_tokens`: prompt tokens whose KV came from the sampler's prefix cache
  instead of being computed (TorchSampler: `SamplerConfig.prefix_cache_tokens`; vLLM:
  its own prefix cache). Logprobs and seeded tokens are the same with or without a hit.
  Only the request's own `owner`'s earlier prompts can hit: a cache entry is keyed by
  owner and weights (vLLM: a per-owner `cache_salt`).
* Streaming (optional): `SamplingRequest.on_tokens(sample, tokens, logprobs)` receives each
  sample's tokens as they are drawn, through `submit_streaming` (backends with
  `Sampler.streams_tokens`: TorchSampler after every decode step, vLLM from its cumulative
  outputs; any other backend once per sequence at the end). Cancelling the Future gives
  up on the request: TorchSampler frees its slots at the next step, vLLM aborts it.
* Fair shares: waiting requests are served by owner, round robin (TorchSampler's
  scheduler; vLLM: priority by the owner's backlog), so one owner's backlog delays
  another's next request by at most the work already running.

Backends (chosen by name: `ember.sampling.registry.SAMPLER_BACKENDS`, `SamplerConfig.backend`):

* `TorchSampler` (torch_sampler.py) runs the same Hugging Face model classes as the
  trainer with its own KV cache and continuous batching.
* `VLLMSampler` (vllm_sampler.py) drives vLLM's V1 engine: `submit` becomes
  `vllm.SamplingParams(n, temperature, top_k, top_p, seed, max_tokens, stop /
  stop_token_ids / ignore_eos=(stop == []), logprobs=k, include_stop_str_in_output)` on
  `AsyncLLM`; LoRA versions are adapters with never-reused ids, full versions are loaded
  in place when their requests run; its module docstring lists where vLLM refuses.
* An SGLang backend would be one more file and one registry line.

The conformance tests of tests/sampling (contract 5, seeds, stops, versions, bad input)
are written against this interface and are what a new backend must pass. Besides the
abstract methods, `Sampler` declares every capability its callers use (the service, a
pool's replicas, weight sync, the metrics), each with the default of a backend without
it, so nobody probes a sampler for an attribute.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

import torch
from tinker import types

from ember.sampling.config import DEFAULT_MAX_TOKENS

LogprobsMode = Literal["raw", "processed"]

TokenCallback = Callable[[int, Sequence[int], Sequence[float]], None]
"""`on_tokens(sample, tokens, logprobs)`: sample `sample`'s newly drawn tokens and their
logprobs, in order, as the backend decodes them (see `Sampler.streams_tokens`)."""

_version_ids = itertools.count(1)


class WeightVersion:
    """Handle to one immutable set of sampling weights of one sampler.

    Hold it for as long as samples must come from these weights; drop it and the
    backend may free the memory (backends keep only weak references). Version ids
    increase with every `load_weights` of the process.
    """

    def __init__(self, sampler_id: int, is_lora: bool, lora_rank: int | None = None) -> None:
        self.version_id = next(_version_ids)
        self.sampler_id = sampler_id
        self.is_lora = is_lora
        self.lora_rank = lora_rank

    def __repr__(self) -> str:
        kind = f"lora r={self.lora_rank}" if self.is_lora else "full"
        return f"{type(self).__name__}(id={self.version_id}, {kind})"


@dataclass(frozen=True)
class SamplingRequest:
    """One sampling request: `num_samples` completions of `prompt` from `version`.

    Fields mirror tinker's `SampleRequest` (`prompt_logprobs` is called
    `include_prompt_logprobs` here, as in `SamplingClient.sample`). `sequence_ids`
    optionally names the returned sequences (the service passes the
    `sample_sequence_ids` it handed to the SDK); by default they are generated.

    `owner` names the tenant the request is served for (the service passes the API key's
    owner; "" = nobody in particular, as in-process use). Backends keep tenants apart by
    it: prefix-cache entries are reusable only by the owner that computed them (so
    `prompt_cache_hit_tokens` reflects only the caller's own traffic), and queued work is
    scheduled fairly across owners (docs/architecture.md, trust boundaries).

    `session` names the sampling session the request belongs to (the service passes the
    sampling session id; "" = none): a `SamplerPool` sends all requests of one session
    to one replica (ember.sampling.router). A single backend ignores it.
    """

    prompt: types.ModelInput
    num_samples: int = 1
    sampling_params: types.SamplingParams = field(default_factory=types.SamplingParams)
    version: WeightVersion | None = None
    include_prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None
    logprobs_mode: LogprobsMode | None = None  # None → the sampler's configured default
    sequence_ids: Sequence[str] | None = None
    target_prompt_logprobs: types.TensorData | None = None
    prompt_alt_tokens_k: int = 0
    owner: str = ""
    session: str = ""
    on_tokens: TokenCallback | None = field(default=None, compare=False)  # streaming: `submit_streaming`
    follow: object | None = field(default=None, compare=False)  # a `follow.VersionFollower`: see `follows_mid_sequence`


class UnsupportedModelError(ValueError):
    """A backend cannot serve a model: the message names the model's field (a config.json
    key), its value and what the backend supports."""


class Sampler(abc.ABC):
    """A sampling backend for one base model (see the module docstring for semantics)."""

    streams_tokens: bool = False
    """Optional capability: True when `submit` calls a request's `on_tokens` as tokens are
    decoded (on the backend's thread: keep it short, never block) and a cancelled Future
    frees the request's slots at the backend's next step. Callers go through
    `submit_streaming`, which gives every other backend the same contract at the end."""

    follows_mid_sequence: bool = False
    """Optional capability: True when a request's `follow` handle (`ember.sampling.follow`)
    is honoured before every decode step, so its running sequences switch to a newly published
    version at their next token (KV of earlier tokens kept) and each sequence carries its
    `version_spans` (TorchSampler reads it each step; vLLM subscribes to it and pauses its
    engine between steps: `vllm_follow.py`). Other backends ignore `follow`: a request
    samples from `version` to its end (per-request adoption). A `SamplerPool` declares it
    when its replicas' backend does."""

    @classmethod
    def check_model(cls, model_dir, config) -> None:
        """Raise `UnsupportedModelError` when this backend cannot serve the model in
        `model_dir` with `config` (a resolved `SamplerConfig`). Called when a sampler is
        created and, for registered models, at service start-up, so a model the backend
        cannot run is refused with its reason instead of failing at the first sample.
        The default accepts every model (the trainer's transformers classes serve it)."""

    # ------------------------------------------------------------------ abstract
    @abc.abstractmethod
    def submit(self, request: SamplingRequest) -> Future:
        """Queue a request; the Future resolves to a `types.SampleResponse`.

        A bad request (ValueError naming the field, expected vs got) fails its own
        Future only; all other requests keep being served. Never blocks on the work.
        """

    @abc.abstractmethod
    def load_weights(
        self,
        named_weights: Iterable[tuple[str, torch.Tensor]],
        lora_config: types.LoraConfig | None = None,
        *,
        copy: bool = True,
    ) -> WeightVersion:
        """Make a new immutable version from (name, tensor) pairs.

        `lora_config=None`: full fine-tuning — every parameter of the base model, in HF
        names (`model.layers.0.self_attn.q_proj.weight`). With a LoraConfig: adapter
        weights only, in PEFT saved-adapter names
        (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), scaled by
        `ember.models.LORA_ALPHA / rank`; the base weights are shared by all versions.
        `copy=False` lets the version keep the given tensors when they are already on the
        sampler's device and dtype (the caller promises never to modify them, as
        `TrainingEngine.named_weights()` does).
        """

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids the model accepts (rows of its embedding)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving: pending requests fail with RuntimeError; resources are released."""

    # ------------------------------------------------------------------ capabilities callers use
    # Every sampler answers these (callers never probe with getattr/hasattr); the defaults
    # are the answers of a backend without the capability.
    model: torch.nn.Module | None = None
    """The module the sampler runs, when it holds one in this process (TorchSampler): a
    weight-sync receiver checks a header against it before any data moves. None otherwise."""
    max_len: int | None = None
    """Longest prompt + completion a request may reach (None: no limit of the sampler's own)."""
    eos_token_ids: tuple[int, ...] = ()
    """The token ids that end a sequence when a request's `stop` is None."""

    @property
    def default_max_tokens(self) -> int:
        """`max_tokens` of a request that leaves it unset (`SamplerConfig.default_max_tokens`)."""
        return DEFAULT_MAX_TOKENS

    def sleep(self) -> None:
        """Colocation (`SamplerConfig.colocate`): release memory to the trainer once the
        requests in progress are done; the next request wakes the sampler. Default: a
        backend without a sleep mode has nothing to release."""

    @property
    def sleep_stats(self) -> dict | None:
        """The sleep mode's `asleep`, `sleeps`, `wakes`; None for a backend without one."""
        return None

    def version_weights(self, version: WeightVersion) -> Mapping[str, torch.Tensor] | None:
        """The tensors of `version` (one of this sampler's) as `load_weights` takes them back:
        a full version in the model's own parameter names, a LoRA version in peft's
        saved-adapter names (`base_model.model.<module>.lora_A.weight`), so that a restart
        can write it to disk and load it again exactly (README "Restarts"). Default None:
        this backend cannot hand a version's weights back."""
        return None

    def replica_stats(self) -> list[dict] | None:
        """Per replica: `replica`, `up`, `requests_total`, `in_flight`, `restarts`; None for
        a sampler that is not a pool of replicas."""
        return None

    def load(self) -> dict[str, int] | None:
        """Sequences decoding now (`active_slots`) and requests waiting for a slot
        (`waiting_requests`); None for a backend that does not count them."""
        return None

    # ------------------------------------------------------------------ conveniences
    def submit_many(self, requests: Sequence[SamplingRequest]) -> list[Future]:
        """`submit` each request; a backend may enqueue them together, so that requests
        handed over at once start in the same batch (one prefill, aligned decoding)."""
        return [self.submit(r) for r in requests]

    def sample(
        self,
        prompt: types.ModelInput,
        num_samples: int = 1,
        sampling_params: types.SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        prompt_logprobs_last_n: int | None = None,
        *,
        version: WeightVersion | None = None,
        logprobs_mode: LogprobsMode | None = None,
        timeout: float | None = None,
        target_prompt_logprobs: types.TensorData | None = None,
        prompt_alt_tokens_k: int = 0,
    ) -> types.SampleResponse:
        """Blocking `submit(...).result()`; positional arguments as `SamplingClient.sample`'s."""
        request = SamplingRequest(
            prompt=prompt,
            num_samples=num_samples,
            sampling_params=sampling_params or types.SamplingParams(),
            version=version,
            include_prompt_logprobs=include_prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            topk_sample_logprobs=topk_sample_logprobs,
            prompt_logprobs_last_n=prompt_logprobs_last_n,
            logprobs_mode=logprobs_mode,
            target_prompt_logprobs=target_prompt_logprobs,
            prompt_alt_tokens_k=prompt_alt_tokens_k,
        )
        return self.submit(request).result(timeout)

    def sample_many(
        self, requests: Sequence[SamplingRequest], timeout: float | None = None
    ) -> list[types.SampleResponse | Exception]:
        """Submit all requests at once (they are batched together); a failed request's
        entry is its exception, the others still complete."""
        futures = self.submit_many(requests)
        results: list[types.SampleResponse | Exception] = []
        for fut in futures:
            try:
                results.append(fut.result(timeout))
            except Exception as exc:  # noqa: BLE001 - returned to the caller by design
                results.append(exc)
        return results

    def compute_logprobs(
        self,
        prompt: types.ModelInput,
        version: WeightVersion | None = None,
        prompt_logprobs_last_n: int | None = None,
    ) -> list[float | None]:
        """logp(prompt[i] | prompt[:i]) for every position; None at position 0.

        As in the SDK, a one-token sample at temperature 1 with prompt logprobs on.
        """
        params = types.SamplingParams(max_tokens=1, temperature=1.0, top_k=-1, top_p=1.0)
        response = self.sample(
            prompt, 1, params, include_prompt_logprobs=True, prompt_logprobs_last_n=prompt_logprobs_last_n,
            version=version,
        )
        assert response.prompt_logprobs is not None
        return response.prompt_logprobs

    def __enter__(self) -> "Sampler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def submit_streaming(sampler: Sampler, request: SamplingRequest) -> Future:
    """`sampler.submit(request)`, with `request.on_tokens` called for every sampled token:
    as decoded where the backend `streams_tokens`, else once per sequence when the request
    completes (a backend that does not stream never sees the callback). Cancel the Future
    to give up on the request: a streaming backend frees its slots at once."""
    if request.on_tokens is None or sampler.streams_tokens:
        return sampler.submit(request)
    on_tokens = request.on_tokens
    future = sampler.submit(dataclasses.replace(request, on_tokens=None))

    def replay(done: Future) -> None:
        if done.cancelled() or done.exception() is not None:
            return
        for index, seq in enumerate(done.result().sequences):
            on_tokens(index, list(seq.tokens), list(seq.logprobs or []))

    future.add_done_callback(replay)
    return future
