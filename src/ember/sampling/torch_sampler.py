"""`TorchSampler`: the Hugging Face model classes the trainer uses, with a slot KV cache,
continuous batching and versioned weights.

    sampler = TorchSampler.from_pretrained(model_dir, SamplerConfig())
    v1 = sampler.load_weights(engine.named_weights(), lora_config=engine.lora_config)
    response = sampler.sample(types.ModelInput.from_ints(prompt), 4,
                              types.SamplingParams(max_tokens=32, temperature=0.7, seed=1), version=v1)

Requests are queued by `submit` (any thread) and served by one worker thread, started
when work arrives and gone again when there is none (nothing to shut down in tests).
Every forward runs on that thread, so the KV cache, the LoRA hooks and the module never
see two forwards at once; `load_weights` only builds new tensors and may run anywhere.

Done-callbacks of the returned futures run on that worker thread: keep them short.

Numerics: in fp32 on CPU the sampler's logprobs match a plain full forward (and the
engine's `forward`) to ~1e-6 (tests assert 1e-4). In bf16 on GPU, batched decode with a
KV cache and the trainer's packed forward round differently (bf16 keeps 8 mantissa
bits): per-token differences of order 1e-2 are expected; tests/sampling/test_sampling_gpu.py
bounds them at 0.15 against an fp32 CPU reference (fp32 on CUDA: 1e-3). Where exact
importance weights matter, take the trainer's logprobs, or sample in fp32.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future

import torch
from tinker import types
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ember.errors import UserError
from ember.models import load_model, load_tokenizer
from ember.models.batch_invariant import batch_invariant, use_batch_invariant_attention
from ember.models.families import moe_of, non_full_attention_layers
from ember.models.vision import VisionSpec, load_vision_spec
from ember.models.loading import effective_attention, resolve_dtype
from ember.sampling.base import Sampler, SamplingRequest, WeightVersion
from ember.sampling.config import SamplerConfig
from ember.sampling.decoder import unsupported_reason
from ember.sampling.jobs import Job
from ember.sampling.kv_cache import SlotCache
from ember.sampling.layout import column_major_linears
from ember.sampling.prefix_cache import PrefixCache
from ember.sampling.params import effective_max_len, resolve_request
from ember.sampling.params import eos_token_ids as eos_token_ids_of
from ember.sampling.runner import ModelRunner
from ember.sampling.scheduler import Scheduler
from ember.sampling.slots import SlotTable
from ember.sampling.vision import ImageIds, expand_prompt, has_images
from ember.sampling.weights import (
    TorchWeightVersion, build_full_version, build_lora_version, parameter_aliases, version_tensors,
)

log = logging.getLogger(__name__)
_sampler_ids = itertools.count(1)


def _check_supported(model: PreTrainedModel) -> None:
    """Full-attention layers (a KV cache per slot) and linear-attention ones (a recurrent
    state per slot, `kv_cache.RecurrentSlotLayer`); a sliding window is refused."""
    config = model.config.get_text_config()  # a vision-language model's decoder
    other = [t for t in non_full_attention_layers(config) if t != "linear_attention"]
    if other:
        raise ValueError(f"TorchSampler serves full-attention and linear-attention layers; this model has layer "
                         f"types {sorted(set(config.layer_types))}")


def _text_decoder(tokenizer: PreTrainedTokenizerBase | None):
    """token ids -> text, for stop strings (None without a tokenizer: stop strings are refused)."""
    if tokenizer is None:
        return None

    def decode_text(token_ids: list[int]) -> str:
        return tokenizer.decode(token_ids, skip_special_tokens=True)

    return decode_text


class TorchSampler(Sampler):
    """Sampler over a Hugging Face causal LM (see module docstring).

    The sampler owns `model`: it is moved to `config.device`/`config.dtype`, put in eval
    mode with gradients off, given forward hooks for LoRA and, on CPU, its Linear weights
    are stored column-major (same values; `ember.sampling.layout`); do not hand it a
    module a TrainingEngine trains. `eos_token_ids` overrides the EOS taken from the tokenizer
    (else the model's generation config) for `stop=None`.
    """

    streams_tokens = True  # `on_tokens` per decode step; a cancelled Future frees its slots at the next step
    follows_mid_sequence = True  # `SamplingRequest.follow` read before each decode step (sampling/follow.py)

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        config: SamplerConfig | None = None,
        eos_token_ids: Iterable[int] | None = None,
        vision: VisionSpec | None = None,
    ) -> None:
        self.config = config or SamplerConfig()
        self.vision = vision  # a vision-language model's image processor and placeholders (`sampling/vision.py`)
        self._image_ids = ImageIds()
        _check_supported(model)
        self.device = torch.device(self.config.resolved_device)
        self.dtype = resolve_dtype(self.config.resolved_dtype)
        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        if self.device.type == "cpu":
            column_major_linears(self.model)  # same values, faster decode matmuls (see layout.py)
        self.tokenizer = tokenizer
        self.eos_token_ids = (tuple(eos_token_ids) if eos_token_ids is not None else
                              eos_token_ids_of(model.config, getattr(model, "generation_config", None), tokenizer))
        text_config = model.config.get_text_config()
        self.max_len = effective_max_len(self.config.max_len, text_config)
        self._vocab = int(model.get_input_embeddings().num_embeddings)
        self._id = next(_sampler_ids)
        self._names = parameter_aliases(self.model)
        # cuda_graphs: the whole KV cache up front, so its address never changes under a graph
        initial = self.max_len if self.config.cuda_graphs else 256
        cache = self._cache = SlotCache(text_config.num_hidden_layers, self.config.max_slots, self.max_len,
                                        initial_capacity=initial, layer_types=getattr(text_config, "layer_types", None))
        attention = effective_attention(model.config, self.config.attn_implementation)  # as load_model chose
        if self.config.batch_invariant:  # the trainer's kernels (`ember.models.batch_invariant`)
            use_batch_invariant_attention(self.model)
        runner = ModelRunner(self.model, cache, attention,
                             "transformers" if self.config.batch_invariant else self.config.forward)
        self.compile_stats = self._compile(runner) if self.config.compile else None
        self.graph_stats = self._cuda_graphs(runner) if self.config.cuda_graphs else None
        slots = SlotTable(self.config.max_slots, self.max_len, self._vocab)
        # A linear-attention layer's state is its whole sequence's, never a cached prefix's:
        # such a model runs with the prefix cache off (every prompt prefilled in full).
        prefix_tokens = 0 if cache.recurrent else self.config.prefix_cache_tokens
        self.prefix_cache = PrefixCache(prefix_tokens, self.config.prefix_cache_block)
        self._scheduler = Scheduler(runner, slots, self.device, self.config.max_prefill_tokens,
                                    _text_decoder(tokenizer), self.prefix_cache,
                                    self.config.resolved_logprob_chunk_tokens)
        self._versions: weakref.WeakSet[WeightVersion] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._incoming: list[Job] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        # colocation (`sleep`): the worker holds new requests while a sleep drains it
        self._sleep_lock = threading.Lock()
        self._draining = self._asleep = False
        self._sleeps = self._wakes = 0

    def _compile(self, runner: ModelRunner):
        """`SamplerConfig.compile`: the direct decoder's decode kernels compiled, counted
        and cached as the engine's (`ember.engine.compile`)."""
        from ember.engine.compile import CompileStats, use_cache_dir

        if runner.direct is None:
            raise ValueError("SamplerConfig.compile compiles the direct forward, which this model does not have "
                             f"({unsupported_reason(self.model)}): use compile=false")
        stats = CompileStats(cache_dir=use_cache_dir(self.config.compile_cache_dir))
        runner.direct.use_compiled(stats)
        return stats

    def _cuda_graphs(self, runner: ModelRunner):
        """`SamplerConfig.cuda_graphs`: decode steps (base weights or one LoRA version) over
        static shapes, captured per bucket (`ember.sampling.cuda_graphs`); its counters."""
        if self.device.type != "cuda":
            raise ValueError("SamplerConfig.cuda_graphs ([sampler.torch] cuda_graphs) needs a CUDA device; the "
                             f"sampler runs on device {str(self.device)!r}: set cuda_graphs=false")
        if runner.direct is None:
            raise ValueError("SamplerConfig.cuda_graphs captures the direct forward, which this model does not have "
                             f"({unsupported_reason(self.model)}): use cuda_graphs=false")
        return runner.use_static_decode(self.config.max_slots, self.device).stats

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike, config: SamplerConfig | None = None,
                        scratch_dir: str | os.PathLike | None = None) -> "TorchSampler":
        """Load the model and its tokenizer from a local directory (as the engine does).
        `scratch_dir` is unused: TorchSampler keeps its versions in memory."""
        config = config or SamplerConfig()
        model = load_model(model_dir, config.resolved_dtype, config.resolved_device, config.attn_implementation)
        try:
            tokenizer = load_tokenizer(model_dir)
        except (OSError, ValueError):
            tokenizer = None  # stop strings then need a tokenizer; stop token ids still work
        return cls(model, tokenizer, config, vision=load_vision_spec(model_dir, model.config))

    # ------------------------------------------------------------------ Sampler API
    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def default_max_tokens(self) -> int:
        return self.config.default_max_tokens

    @property
    def stats(self) -> dict[str, int]:
        """Counters since construction: prefill forwards and prompts, decode steps and rows, sequences,
        sequences moved to a lower slot as the batch drained (compaction), and prompt logits computed
        from hidden states under `logprob_chunk_tokens` (`unembed_calls`; `unembed_rows_max`: the
        most rows one call was given)."""
        return dict(self._scheduler.stats)

    def load(self) -> dict[str, int]:
        """Read-only: sequences decoding now (`active_slots`) and requests waiting for a slot
        (`waiting_requests`, plus those submitted and not yet handed to the scheduler)."""
        load = self._scheduler.load()  # a snapshot read from another thread: counts, not a consistent view
        with self._lock:
            load["waiting_requests"] += len(self._incoming)
        return load

    @property
    def scheduler(self) -> Scheduler:
        """Read-only: the continuous-batching scheduler this sampler's thread drives (a test
        steps it by hand, reads its `load()` and `busy`)."""
        return self._scheduler

    def live_versions(self) -> int:
        """Versions of this sampler still referenced somewhere."""
        return len(self._versions)

    def load_weights(
        self,
        named_weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        lora_config: types.LoraConfig | None = None,
        *,
        copy: bool = True,
    ) -> TorchWeightVersion:
        items = named_weights.items() if isinstance(named_weights, Mapping) else named_weights
        if lora_config is None:
            version = build_full_version(self._id, items, self._names, self.device, self.dtype, copy,
                                         model_config=self.model.config)
        else:
            version = build_lora_version(self._id, self.model, items, lora_config, self.device, self.dtype, copy)
        self._versions.add(version)
        return version

    def version_weights(self, version: WeightVersion) -> dict[str, torch.Tensor] | None:
        """`Sampler.version_weights`: from the tensors the version keeps (`version_tensors`)."""
        if not isinstance(version, TorchWeightVersion) or version.sampler_id != self._id:
            return None
        return version_tensors(version, moe_of(self.model.config))

    def submit(self, request: SamplingRequest) -> Future:
        return self.submit_many([request])[0]

    def submit_many(self, requests: Sequence[SamplingRequest]) -> list[Future]:
        """Queue all requests under one lock, so the worker admits them in the same step
        (not the first while the caller is still submitting the rest)."""
        futures: list[Future] = []
        jobs: list[Job] = []
        for request in requests:
            future: Future = Future()
            futures.append(future)
            try:
                jobs.append(self.make_job(request, future))
            except ValueError as exc:
                future.set_exception(exc)
        with self._lock:
            if self._closed:
                for job in jobs:
                    job.future.set_exception(RuntimeError("the sampler is closed"))
                return futures
            self._incoming.extend(jobs)
            if jobs and self._thread is None and not self._draining:
                self._start_worker()
        return futures

    def _start_worker(self) -> None:  # under self._lock
        self._thread = threading.Thread(target=self._work, name=f"ember-sampler-{self._id}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            thread.join()

    def make_job(self, request: SamplingRequest, future: Future) -> Job:
        """The scheduler `Job` of a request: checked (its version must be this sampler's) and
        resolved. `submit_many` enqueues these; a test that drives `scheduler` itself (enqueue,
        then `step()`) makes its jobs here. ValueError for a request this sampler refuses."""
        if not isinstance(request, SamplingRequest):
            raise ValueError(f"submit: expected a SamplingRequest, got {type(request).__name__}")
        version = request.version
        if version is not None and (not isinstance(version, TorchWeightVersion) or version.sampler_id != self._id):
            raise ValueError(f"sample request: version: {version!r} was not loaded into this sampler")
        images = cache_prompt = None
        if has_images(request.prompt):
            request, images, cache_prompt = self._expand_images(request)
        spec = resolve_request(
            request, vocab_size=self._vocab, eos_token_ids=self.eos_token_ids, max_len=self.max_len,
            default_max_tokens=self.config.default_max_tokens, default_logprobs_mode=self.config.logprobs_mode,
            can_decode=self.tokenizer is not None,
        )
        return Job(spec, future, version, images, cache_prompt)

    # ------------------------------------------------------------------ internals
    def _expand_images(self, request: SamplingRequest):
        """(the request with its prompt as token ids, its `PromptImages`, the prefix
        cache's view of the prompt); runs on the submitting thread, not the worker's."""
        if self.vision is None:
            j = next(j for j, c in enumerate(request.prompt.chunks) if not isinstance(c, types.EncodedTextChunk))
            raise UserError(f"prompt: chunk {j} is an image, but this model takes text only")
        prompt, images = expand_prompt(request.prompt, self.vision, self.model)
        generation = self._image_ids.generation
        cache_prompt = images.cache_prompt(tuple(prompt.to_ints()), self._image_ids)
        if self._image_ids.generation != generation:  # the id table started again: old keys are void
            self.prefix_cache.clear()
        return dataclasses.replace(request, prompt=prompt), images, cache_prompt

    # ------------------------------------------------------------------ colocation
    @property
    def asleep(self) -> bool:
        """True while a colocated sampler has released its caches to the trainer (read-only)."""
        return self._asleep

    @property
    def kv_cache_bytes(self) -> int:
        """Read-only: bytes the slot KV cache holds now (0 after a colocated `sleep`)."""
        return self._cache.nbytes()

    @property
    def sleep_stats(self) -> dict:
        """Colocation, read-only: `asleep` now, and how many times it slept and woke."""
        with self._lock:
            return {"asleep": self._asleep, "sleeps": self._sleeps, "wakes": self._wakes}

    def debug_state(self) -> dict:
        """The one inspection point of the sampler (read-only): `draining`, a `sleep` is
        waiting for the requests in progress to finish (new ones wait); `sampler_id`, the id
        every `TorchWeightVersion` of this sampler carries (a version of another is refused);
        with `SamplerConfig.compile`, `compile`: graphs compiled so far and inductor's seconds
        on them (`CompileStats.as_dict`; the sampler compiles at its first decode steps, not at
        start: `compiled_layers` is 0 until then and `warmup_seconds` stays 0); with
        `SamplerConfig.cuda_graphs`, `cuda_graphs`: graphs captured, replays, static steps,
        fallbacks by reason, invalidations and capture seconds (`GraphStats.as_dict`)."""
        with self._lock:
            state = {"draining": self._draining, "sampler_id": self._id}
        if self.compile_stats is not None:
            state["compile"] = self.compile_stats.as_dict()
        if self.graph_stats is not None:
            state["cuda_graphs"] = self.graph_stats.as_dict()
        return state

    def sleep(self) -> None:
        """Give the trainer the memory (`SamplerConfig.colocate`): let the requests in
        progress finish (new ones wait), then free the KV cache and the prefix cache (on
        CUDA, back to the driver too). The next request wakes it; its caches grow again on
        demand. The weights stay where they are (vLLM's sleep offloads those as well).
        Does nothing unless `colocate`, or when already asleep."""
        if not self.config.colocate:
            return
        with self._sleep_lock:
            with self._lock:
                if self._closed or self._asleep:
                    return
                self._draining, thread = True, self._thread
            try:
                if thread is not None:
                    thread.join()  # it ends once what it had admitted is done
            finally:
                with self._lock:
                    self._draining = False
                    if self._thread is None and not self._closed:  # drained (not interrupted)
                        self._release_memory()
                    if self._incoming and self._thread is None:
                        self._start_worker()  # what arrived meanwhile wakes it (or fails: closed)

    def _release_memory(self) -> None:  # under self._lock, with no worker running
        self.prefix_cache.clear()
        self._cache.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._asleep = True
        self._sleeps += 1

    def _wake(self) -> None:  # on the worker thread, before its first step
        with self._lock:
            if not self._asleep:
                return
            self._asleep = False
            self._wakes += 1

    def _work(self) -> None:
        """The worker thread: hand new requests to the scheduler, step it until idle."""
        scheduler = self._scheduler
        self._wake()
        while True:
            with self._lock:
                if not self._draining or self._closed:  # a sleep holds new requests back
                    scheduler.enqueue(self._incoming)
                    self._incoming.clear()
                if self._closed or not scheduler.busy:
                    if self._closed:
                        scheduler.fail_everything(RuntimeError("the sampler was closed"))
                    self._thread = None
                    return
            try:
                with torch.inference_mode(), batch_invariant(self.config.batch_invariant):
                    scheduler.step()
            except Exception as exc:  # noqa: BLE001 - a fault fails the requests it touched, not the sampler
                # Per-request faults are failed alone inside step(); what escapes is the shared
                # batched work, which no single request can be blamed for. The message names no
                # request's shapes: those stay in the log.
                log.exception("sampler step failed; failing %d in-flight request(s)", len(scheduler.in_flight()))
                scheduler.fail_in_flight(
                    RuntimeError(f"sampling failed: the batched model forward raised {type(exc).__name__}"))
