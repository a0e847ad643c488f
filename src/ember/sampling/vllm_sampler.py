"""`VLLMSampler`: the `Sampler` interface over vLLM's V1 engine (`AsyncLLM`).

    sampler = VLLMSampler.from_pretrained(model_dir, SamplerConfig(backend="vllm"))
    v1 = sampler.load_weights(engine.named_weights(), lora_config=engine.lora_config)
    response = sampler.sample(prompt, 4, types.SamplingParams(max_tokens=32, seed=1), version=v1)

Requests from any thread are handed to one asyncio event loop (a daemon thread) that
drives the engine; vLLM batches them continuously with its own scheduler and reuses
shared prompt prefixes (prefix caching; `prompt_cache_hit_tokens`), each owner's only
(a per-owner `cache_salt`), and serves owners fairly (`OwnerBacklog`). The engine core runs
in a separate process; it is started in the background on construction and rebuilt on
the next request if it dies (in-flight requests then fail with RuntimeError, which the
service reports as category `server`).

Semantics are the interface's (ember.sampling.base). How they map onto vLLM:
* `num_samples` → `n`; `seed` → vLLM's per-request seed (sample i uses seed + i), so the
  tokens do not depend on batch neighbours; `stop` strings / token ids / None (EOS) /
  [] (`ignore_eos`), with the stop string's tokens included (`include_stop_str_in_output`).
* Logprobs are vLLM's `raw_logprobs` (softmax of the logits, Tinker's semantics) or, with
  `SamplerConfig.logprobs_mode="processed"`, `processed_logprobs`. vLLM fixes the mode per
  engine, so a request asking for the other mode is refused (field `logprobs_mode`).
* `topk_sample_logprobs` ≤ `SamplerConfig.max_logprobs` (vLLM's `max_logprobs`);
  `temperature` ≤ 2 (vLLM's range; hotter is refused); a temperature below 1e-5 is greedy
  (its limit; vLLM would overflow), and greedy `num_samples` > 1 are one argmax path
  returned n times (vLLM refuses n > 1 for greedy requests).
* Prompt logprobs (`include_prompt_logprobs`, `topk_prompt_logprobs`,
  `prompt_logprobs_last_n`, `compute_logprobs`, `target_prompt_logprobs`,
  `prompt_alt_tokens_k`, which vLLM has no parameter for) are computed by a TorchSampler over the
  same model and versions in this process ("the scorer", created on first use): vLLM 0.32
  computes prompt logprobs with the per-sequence LoRA mapping, so with LoRA enabled it
  drops the lm_head adapter's delta on GPU and fails on CPU (vllm-project/vllm#51594,
  #29955). The scorer gives exactly the trainer's numbers (contract 5); it costs a second
  copy of the base weights on `SamplerConfig.device` once used.

Weight versions (`vllm_versions.py`): a LoRA version is a peft adapter on disk served as a
LoRA request with a never-reused id, removed from the engine and disk when the version is
dropped; up to `max_loras` adapters share a batch. A full fine-tuning version is a
safetensors file; the engine holds one full set at a time, so requests pinned to
different sets take turns (`WeightGate`: drain the running set, load the next with the
vLLM's in-place `reload_weights` in the engine process, reset the prefix cache, resume). A swap
costs one read of the version's file plus the drain; benchmarks/sampling.py measures it.

How a full version enters the engine is the sampler's `EngineTransport`
(`ember.sampling.transport.engine`, chosen once from `SamplerConfig.weight_sync`): files
as above, or with "memory" a full version kept as tensors in this process
(`keep_full_version`) that a swap pushes through vLLM's weight-transfer API
(`init_weight_transfer_engine` once per engine, then `start_weight_update` /
`update_weights` / `finish_weight_update`; `vllm_weight_engine.WeightPusher`: the
`ember_gloo` engine on CPU, vLLM's `ipc` on CUDA): no file is written. LoRA versions stay
adapter directories on disk: vLLM 0.32 loads an adapter only from a path
(`LoRARequest.lora_path`; benchmarks/vllm_lora_files.py measures what the files cost).
Swapping back to the base weights reads the base model's own files.

In-flight weights (`SamplingRequest.follow`): a followed request runs on its follower's
slot in the engine, and a publish is adopted mid-sequence, between two engine steps, with
the queue and KV cache kept (`vllm_follow.py`; `follows_mid_sequence`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import hashlib
import itertools
import logging
import os
import tempfile
import threading
import uuid
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch
import vllm  # noqa: F401 - imported here so the registry reports a missing vLLM with its install hint
from tinker import types

from ember.errors import UserError
from ember.fairness import owner_cap
from ember.models.loading import resolve_dtype
from ember.sampling.base import Sampler, SamplingRequest, WeightVersion
from ember.sampling.config import SamplerConfig
from ember.sampling.follow import with_spans
from ember.sampling.jobs import sampled_sequence
from ember.sampling.params import ResolvedRequest, effective_max_len, eos_token_ids, resolve_request
from ember.sampling.scoped_env import scoped_env
from ember.sampling.vllm_support import check_vllm_model, engine_fault_message, engine_kwargs  # noqa: F401 - re-exported
from ember.sampling.transport.engine import MemoryEngineTransport, engine_transport, reload_from_files
from ember.sampling.vllm_follow import EngineFollows, FollowedPart, FollowSlot
from ember.sampling.vllm_versions import (
    BASE_KEY, VLLMWeightVersion, lora_refused_modules, meta_model, remove_version_files, write_lora_version,
)
from ember.sampling.weight_gate import WeightGate

log = logging.getLogger(__name__)
_sampler_ids = itertools.count(1)
_SEED_SPAN = 1 << 62  # vLLM seeds are int64 and sample i uses seed + i
MAX_TEMPERATURE = 2.0  # vLLM refuses hotter sampling
GREEDY_BELOW = 1e-5  # vLLM's own epsilon: logits / T overflow below it; the limit is the argmax


def is_greedy(spec: ResolvedRequest) -> bool:
    return spec.temperature < GREEDY_BELOW


def needs_scorer(spec: ResolvedRequest) -> bool:
    """Prompt scores of any kind (vLLM has no `target_prompt_logprobs` / `prompt_alt_tokens_k`)."""
    return spec.scores_prompt


# How long a CPU engine core may take to exit after SIGTERM before it is killed. Its graceful
# exit ends in a full `gc.collect()` over the imported vLLM/torch heap (`cleanup_dist_env_and_memory`),
# which took longer than vLLM's default 5 s grace on a 2-core machine every time it was watched,
# so the core was killed anyway, 5 s of CPU and wall later (per engine close and per rebuild after
# a crash). A CPU core holds no device memory a kill could strand; on a GPU vLLM's default
# grace stays, for its device teardown.
CPU_ENGINE_EXIT_GRACE_S = 0.5


def _shut_down(llm, device: str) -> None:
    """Shut an AsyncLLM down once. Its `__del__` calls `shutdown()` again whenever the object
    is collected; at interpreter exit the module globals that method uses are already None,
    which printed `TypeError: 'NoneType' object is not callable` as the last line of every
    process that used vLLM. The instance's second call is made a no-op."""
    llm.shutdown(timeout=CPU_ENGINE_EXIT_GRACE_S if device == "cpu" else None)
    llm.shutdown = lambda *args, **kwargs: None


def _close_at_exit(ref: weakref.ref) -> None:
    """atexit: close a sampler its owner never closed, while the interpreter is intact."""
    sampler = ref()
    if sampler is not None:
        sampler.close()


def check_engine_limits(spec: ResolvedRequest, config: SamplerConfig) -> None:
    """Refuse what a vLLM engine started with `config` cannot do, naming the request field."""
    if spec.logprobs_mode != config.logprobs_mode and not needs_scorer(spec):
        raise UserError(f"sample request: logprobs_mode: expected {config.logprobs_mode!r} (a vLLM engine "
                        f"computes one kind, set by SamplerConfig.logprobs_mode), got {spec.logprobs_mode!r}")
    if spec.temperature > MAX_TEMPERATURE:
        raise UserError(f"sample request: sampling_params.temperature: expected a number in [0, {MAX_TEMPERATURE}] "
                        f"(vLLM's range), got {spec.temperature}")
    if spec.topk_sample_logprobs > config.max_logprobs:
        raise UserError(f"sample request: topk_sample_logprobs: expected at most {config.max_logprobs} "
                        f"(SamplerConfig.max_logprobs), got {spec.topk_sample_logprobs}")


def check_lora_enabled(config: SamplerConfig) -> None:
    """A LoRA version needs adapter slots in the engine (`enable_lora`)."""
    if not config.enable_lora:
        raise ValueError("this vLLM sampler serves no LoRA versions (SamplerConfig.enable_lora is off); "
                         "turn it on to sample from a LoRA run")


class VLLMSampler(Sampler):
    """Sampler over vLLM's AsyncLLM (see the module docstring)."""

    # `on_tokens`: vLLM's cumulative outputs, step by step; a cancelled Future cancels the
    # request's task, and AsyncLLM.generate aborts the request in the engine
    streams_tokens = True
    follows_mid_sequence = True  # `SamplingRequest.follow`: adopted between engine steps (vllm_follow.py)

    def __init__(self, model_dir: str | os.PathLike, config: SamplerConfig | None = None,
                 scratch_dir: str | os.PathLike | None = None) -> None:
        self.config = config or SamplerConfig(backend="vllm")
        self.model_dir = Path(model_dir)
        self.check_model(self.model_dir, self.config)  # before an engine process is started
        self.dtype = resolve_dtype(self.config.resolved_dtype)
        self._id = next(_sampler_ids)
        self._meta = meta_model(self.model_dir)
        self._vocab = int(self._meta.get_input_embeddings().num_embeddings)
        self._lora_refused = lora_refused_modules(self._meta.config)
        self.max_len = effective_max_len(self.config.max_len, self._meta.config)
        self.tokenizer = _load_tokenizer(self.model_dir)
        self.eos_token_ids = eos_token_ids(self._meta.config, _generation_config(self.model_dir), self.tokenizer)
        self._scratch = Path(scratch_dir or tempfile.mkdtemp(prefix="ember-vllm-")) / f"sampler-{uuid.uuid4().hex[:8]}"
        self._scratch.mkdir(parents=True)
        self._versions: weakref.WeakSet[WeightVersion] = weakref.WeakSet()
        self._scorer = None
        self._scorer_lock = threading.Lock()
        self._llm = None
        self._gate = WeightGate(BASE_KEY)
        self._backlog = OwnerBacklog()
        self._asleep = False  # colocate: the engine released the GPU for the trainer
        self._sleeps = self._wakes = 0
        self._transport = engine_transport(self.config)  # how full versions enter the engine
        self._follows = EngineFollows(self)
        self.engine_starts = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"ember-vllm-{self._id}", daemon=True)
        self._thread.start()
        self._start_lock = asyncio.Lock()
        self._closed = False
        self._call(self._ensure_engine())  # start in the background; requests wait for it
        atexit.register(_close_at_exit, weakref.ref(self))

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike, config: SamplerConfig | None = None,
                        scratch_dir: str | os.PathLike | None = None) -> "VLLMSampler":
        return cls(model_dir, config, scratch_dir)

    @classmethod
    def check_model(cls, model_dir: str | os.PathLike, config: SamplerConfig) -> None:
        check_vllm_model(model_dir, config.resolved_device)  # see vllm_support.py

    # ------------------------------------------------------------------ Sampler API
    @property
    def vocab_size(self) -> int:
        return self._vocab

    def live_versions(self) -> int:
        return len(self._versions)

    def load(self) -> dict[str, int]:
        """Read-only: samples in the engine now (`active_slots`: admitted by `OwnerBacklog`,
        running or in vLLM's own queue) and request parts waiting for their owner's room
        (`waiting_requests`); read from another thread, so counts, not a consistent view."""
        return {"active_slots": sum(dict(self._backlog.samples).values()), "waiting_requests": self._backlog.waiting}

    @property
    def default_max_tokens(self) -> int:
        return self.config.default_max_tokens

    def debug_state(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """The one inspection point of the sampler (read-only): `weights_in_memory` (full versions
        enter the engine through vLLM's weight-transfer API, weight_sync="memory", not files),
        `weight_swaps` (weight loads into the engine completed, `WeightGate.swaps`),
        `engine_pids` (the running engine core's processes), `loaded_lora_ids` (the LoRA ids
        the engine holds now; a released version's id leaves it), asked within `timeout_s`, and
        `inflight_adoptions` (publishes adopted while followed requests ran: `vllm_follow.py`)."""
        return {"weights_in_memory": isinstance(self._transport, MemoryEngineTransport),
                "weight_swaps": self._gate.swaps, "engine_pids": self._engine_pids(),
                "loaded_lora_ids": self._loaded_lora_ids(timeout_s),
                "inflight_adoptions": self._follows.adoptions}

    def load_weights(self, named_weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                     lora_config: types.LoraConfig | None = None, *, copy: bool = True) -> VLLMWeightVersion:
        items = named_weights.items() if isinstance(named_weights, Mapping) else named_weights
        if lora_config is None:
            version = self._transport.full_version(self._id, self._meta, items, self.dtype, self._scratch, copy)
        else:
            check_lora_enabled(self.config)
            version = write_lora_version(self._id, self._meta, items, lora_config, self.dtype,
                                         self.config.max_lora_rank, self._scratch, self._lora_refused)
        weakref.finalize(version, _release, weakref.ref(self), version.path, version.lora_id)
        self._versions.add(version)
        return version

    def submit(self, request: SamplingRequest) -> Future:
        try:
            spec, version = self._resolve(request)
        except (ValueError, RuntimeError) as exc:  # a bad request, or the sampler is closed
            future: Future = Future()
            future.set_exception(exc)
            return future
        if needs_scorer(spec):
            return self._score(request, version)
        return self._call(self._serve(spec, version))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._shutdown()).result(timeout=60)
        except Exception:  # noqa: BLE001 - closing anyway
            log.exception("vLLM engine shutdown failed")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
        gc.collect()  # collect the engine client now, not at interpreter exit (its __del__ then fails)
        if self._scorer is not None:
            self._scorer.close()
        self._transport.close()
        remove_version_files(self._scratch)

    # ------------------------------------------------------------------ for vllm_follow (its loop thread)
    @property
    def closed(self) -> bool:
        return self._closed

    def engine_if_running(self):
        """The engine when it is up and awake (an adoption then loads into it), else None."""
        return self._llm if self._llm is not None and not self._llm.errored and not self._asleep else None

    def owns(self, version) -> bool:
        return isinstance(version, VLLMWeightVersion) and version.sampler_id == self._id

    def gate_loaded(self) -> str:
        return self._gate.loaded

    async def load_full_set(self, llm, version: VLLMWeightVersion | None, key: str) -> None:
        """Load a full set in place: `version`'s weights, or the base model's (None)."""
        if version is None:
            await reload_from_files(llm, self.model_dir)
        else:
            await self._transport.load_full(llm, version, key)

    def call_soon(self, fn, *args) -> None:
        """Run `fn(*args)` on the sampler's loop (from any thread)."""
        self._loop.call_soon_threadsafe(fn, *args)

    def remove_lora_soon(self, lora_id: int) -> None:
        self._call(self._remove_lora(lora_id))

    # ------------------------------------------------------------------ requests
    def _resolve(self, request: SamplingRequest) -> tuple[ResolvedRequest, VLLMWeightVersion | None]:
        if self._closed:
            raise RuntimeError("the sampler is closed")
        if not isinstance(request, SamplingRequest):
            raise ValueError(f"submit: expected a SamplingRequest, got {type(request).__name__}")
        version = request.version
        if version is not None and (not isinstance(version, VLLMWeightVersion) or version.sampler_id != self._id):
            raise ValueError(f"sample request: version: {version!r} was not loaded into this sampler")
        spec = resolve_request(
            request, vocab_size=self._vocab, eos_token_ids=self.eos_token_ids, max_len=self.max_len,
            default_max_tokens=self.config.default_max_tokens, default_logprobs_mode=self.config.logprobs_mode,
            can_decode=self.tokenizer is not None,
        )
        check_engine_limits(spec, self.config)
        return spec, version

    def _call(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _serve(self, spec: ResolvedRequest, version: VLLMWeightVersion | None) -> types.SampleResponse:
        if spec.max_tokens == 0:
            return _empty_response(spec)
        try:
            return _response(await self._generate(spec, version), spec)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - an engine fault: category server, without its frames
            error = RuntimeError(engine_fault_message(exc))
        # raised here, outside the handler, so the failed request keeps no reference to a dead engine
        raise error

    async def _generate(self, spec: ResolvedRequest, version: VLLMWeightVersion | None):
        llm = await self._ensure_engine()
        if self._asleep:
            await self._wake(llm)
        slot = self._follows.slot(spec.request.follow, version) if spec.request.follow is not None else None
        key = version.weights_key if version is not None else BASE_KEY
        if slot is not None and not slot.lora:
            key = slot.gate_key
        n = 1 if is_greedy(spec) else spec.num_samples
        cap = owner_cap(self.config.max_slots)
        async with self._gate.hold(key, lambda k: self._swap(llm, k, version, slot, spec.request.follow)):
            finals = await asyncio.gather(*(self._generate_part(llm, spec, version, start, min(cap, n - start), slot)
                                            for start in range(0, n, cap)))
        return _merged(finals)

    async def _generate_part(self, llm, spec: ResolvedRequest, version, start: int, size: int,
                             slot: FollowSlot | None = None):
        """Samples [start, start + size) of a request (sample i is seeded seed + i, as in one
        request), admitted when its owner has room in the engine (`OwnerBacklog`); a followed
        request's part (`slot`) is registered with its follower's slot while it runs."""
        owner = spec.request.owner
        async with self._backlog.admit(owner, size, owner_cap(self.config.max_slots)):
            part = None
            if slot is not None:
                part = await self._follows.start_part(llm, spec.request.follow, slot, size)
            try:
                final = await self._run_part(llm, spec, version, start, size, slot, part)
            finally:
                if part is not None:
                    self._follows.end_part(slot, part)
        for completion in final.outputs:
            completion.index += start
        return final, start, part

    async def _run_part(self, llm, spec: ResolvedRequest, version, start: int, size: int,
                        slot: FollowSlot | None, part: FollowedPart | None):
        final = None
        sent: dict[int, int] = {}  # streamed requests: sample -> tokens handed to on_tokens
        latest: dict[int, object] = {}  # and each sample's newest completion (cumulative outputs)
        cumulative = spec.request.on_tokens is not None or part is not None
        lora = self._follows.lora_request(slot) if slot is not None and slot.lora else _lora_request(version)
        salt = slot.salt(spec.request.owner) if slot is not None else spec.request.owner
        async for final in llm.generate(_prompt(spec, salt), _params(spec, start, size, cumulative), uuid.uuid4().hex,
                                        lora_request=lora, priority=self._backlog.priority(spec.request.owner)):
            if spec.request.on_tokens is not None:
                _stream_part(final, spec, start, sent)
            if cumulative:
                latest.update((c.index, c) for c in final.outputs)
            if part is not None:
                for c in final.outputs:
                    part.saw(c.index, len(c.token_ids), c.finish_reason is not None)
        if final is None:
            raise RuntimeError("the vLLM engine returned no output for the request")
        if latest:  # a cumulative output holds the completions that changed in its step only
            final.outputs = [latest[index] for index in sorted(latest)]
        return final

    def _score(self, request: SamplingRequest, version: VLLMWeightVersion | None) -> Future:
        """Prompt scores by the torch scorer, on the request's version (a followed request is
        scored on the version it was submitted with: the scorer follows no target)."""
        scorer = self._scorer_sampler()
        scorer_version = None
        if version is not None:
            with self._scorer_lock:
                if version.scorer_version is None:
                    version.scorer_version = scorer.load_weights(version.named_tensors(), version.lora_config)
                scorer_version = version.scorer_version
        return scorer.submit(_with_version(request, scorer_version))

    def _scorer_sampler(self):
        with self._scorer_lock:
            if self._scorer is None:
                from dataclasses import replace

                from ember.sampling.torch_sampler import TorchSampler

                cfg = replace(self.config, backend="torch", max_slots=min(self.config.max_slots, 16))
                self._scorer = TorchSampler.from_pretrained(self.model_dir, cfg)
            return self._scorer

    # ------------------------------------------------------------------ engine
    async def _ensure_engine(self):
        async with self._start_lock:
            if self._llm is not None and not self._llm.errored:
                return self._llm
            if self._closed:
                raise RuntimeError("the sampler is closed")
            if self._llm is not None:
                log.error("vLLM engine died (%s); starting a new one", self._llm.dead_error)
                device = self.config.resolved_device
                await asyncio.get_running_loop().run_in_executor(None, _shut_down, self._llm, device)
                self._llm = None
            start = asyncio.get_running_loop().run_in_executor(None, self._start_engine)
            self._llm = await asyncio.wait_for(start, self.config.engine_start_timeout_s)
            await self._transport.init(self._llm)
            self.engine_starts += 1
            self._asleep = False
            self._gate.reset(BASE_KEY)
            return self._llm

    def _start_engine(self):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if self.config.resolved_device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(self.config.kv_cache_gb))))
        kwargs = engine_kwargs(self.model_dir, self.config, self.max_len)
        kwargs.update(self._transport.engine_options())
        args = AsyncEngineArgs(**kwargs)
        with _device_env(self.config):  # the engine core starts on the sampler's GPU(s)
            with _multiprocessing_env(self.config):
                vllm_config = args.create_engine_config()
            return AsyncLLM.from_vllm_config(vllm_config, enable_log_requests=args.enable_log_requests,
                                             disable_log_stats=args.disable_log_stats)

    async def _swap(self, llm, key: str, version: VLLMWeightVersion | None, slot: FollowSlot | None = None,
                    follower=None) -> None:
        if slot is not None and key == slot.gate_key:
            await self._follows.load_gate(llm, follower, slot)
            return
        if key == BASE_KEY:
            await reload_from_files(llm, self.model_dir)
        else:
            await self._transport.load_full(llm, version, key)
        await llm.reset_prefix_cache()  # cached KV was computed with the previous weights

    async def _remove_lora(self, lora_id: int) -> None:
        if self._llm is not None and not self._llm.errored:
            await self._llm.remove_lora(lora_id)

    async def _shutdown(self) -> None:
        async with self._start_lock:
            if self._llm is not None:
                # on the loop's own thread, not an executor's: at interpreter exit (the atexit
                # close) the default executor no longer takes work; nothing else runs here now
                _shut_down(self._llm, self.config.resolved_device)
                self._llm = None

    def _loaded_lora_ids(self, timeout_s: float) -> set[int]:
        """The LoRA ids the running engine holds now (empty before it started)."""
        async def ids() -> set[int]:
            return set(await self._llm.list_loras()) if self._llm is not None and not self._llm.errored else set()

        return self._call(ids()).result(timeout_s)

    def _engine_pids(self) -> list[int]:
        """Process ids of the running engine core."""
        import psutil

        pids = []
        for proc in psutil.Process().children(recursive=True):
            try:
                if proc.name().startswith("VLLM") or "EngineCore" in " ".join(proc.cmdline()):
                    pids.append(proc.pid)
            except psutil.Error:  # gone or not ours to read
                continue
        return pids

    # ------------------------------------------------------------------ colocation (CUDA)
    @property
    def asleep(self) -> bool:
        """True while a colocated engine has released the GPU to the trainer (read-only)."""
        return self._asleep

    @property
    def sleep_stats(self) -> dict:
        """Colocation, read-only: `asleep` now, and how many times it slept and woke."""
        return {"asleep": self._asleep, "sleeps": self._sleeps, "wakes": self._wakes}

    def sleep(self) -> None:
        """Give the GPU to the trainer: wait for running requests, then release the engine's
        weights (offloaded to host memory) and KV cache (vLLM sleep mode, level 1). The next
        request wakes it. Does nothing unless `SamplerConfig.colocate` (CUDA only)."""
        if self.config.colocate and not self._closed:
            self._call(self._sleep()).result()

    async def _sleep(self) -> None:
        async with self._start_lock:
            if self._llm is not None and not self._llm.errored and not self._asleep:
                await self._llm.sleep(level=1, mode="wait")
                self._asleep = True
                self._sleeps += 1

    async def _wake(self, llm) -> None:
        async with self._start_lock:
            if self._asleep:
                await llm.wake_up()
                self._asleep = False
                self._wakes += 1


_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _multiprocessing_env(config: SamplerConfig):
    """On CPU, vLLM's platform turns the single-process executor ("uni") into a worker
    process unless VLLM_ENABLE_V1_MULTIPROCESSING is "0" while the engine's config is made
    (it reads the variable there, in this process): set from `cpu_worker` for that moment
    only, so that samplers of either kind start side by side, then the caller's value is back."""
    if config.resolved_device != "cpu":
        yield
        return
    with scoped_env(_ENV_LOCK, "VLLM_ENABLE_V1_MULTIPROCESSING", "0" if config.cpu_worker == "inline" else "1"):
        yield


@contextlib.contextmanager
def _device_env(config: SamplerConfig):
    """On CUDA, CUDA_VISIBLE_DEVICES names the sampler's GPU(s) (`visible_devices`) while
    vLLM makes its config and starts its engine core, which inherits it; then the caller's
    value is back. CUDA is initialised here first, so this process keeps its own view of
    the GPUs whatever vLLM touches meanwhile."""
    if config.resolved_device == "cpu":
        yield
        return
    from ember.sampling.vllm_support import visible_devices

    torch.cuda.init()
    with scoped_env(_ENV_LOCK, "CUDA_VISIBLE_DEVICES",
                    lambda before: visible_devices(config.resolved_device, config.tensor_parallel_size, before)):
        yield


def _release(sampler_ref, path: Path, lora_id: int | None) -> None:
    """Finalizer of a version: forget its adapter in the engine and delete its files."""
    sampler = sampler_ref()
    if lora_id is not None and sampler is not None and not sampler._closed:
        try:
            sampler._call(sampler._remove_lora(lora_id))
        except RuntimeError:  # the loop is gone (interpreter exit)
            pass
    remove_version_files(path)


def _load_tokenizer(model_dir: Path):
    from ember.models import load_tokenizer

    try:
        return load_tokenizer(model_dir)
    except (OSError, ValueError):
        return None


def _generation_config(model_dir: Path):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir)
    except OSError:
        return None


def _with_version(request: SamplingRequest, version) -> SamplingRequest:
    from dataclasses import replace

    return replace(request, version=version, follow=None)


def _prompt(spec: ResolvedRequest, salted: str):
    """The request's tokens, its prefix-cache salt made from `salted` (the owner; for a
    followed request its follow slot and generation too: `FollowSlot.salt`)."""
    from vllm.inputs import TokensPrompt

    salt = cache_salt(salted)
    return TokensPrompt(prompt_token_ids=list(spec.prompt), **({"cache_salt": salt} if salt else {}))


def cache_salt(owner: str) -> str | None:
    """vLLM's per-request prefix-cache salt: blocks hashed with different salts never match,
    so a request reuses only its own owner's cached prefixes (None: no owner, no salt)."""
    return hashlib.sha256(owner.encode("utf-8", "surrogatepass")).hexdigest()[:32] if owner else None


class OwnerBacklog:
    """Each owner's samples in the engine, admission by owner, and vLLM priorities.

    Fair shares on vLLM (the policy): a request is split into parts of at most
    `ember.fairness.owner_cap` samples; a part enters the engine only while its owner has room
    under that cap (waiting in ember otherwise), so one owner never fills every engine
    sequence and another owner's next request starts without waiting for them to end. The
    engine runs with `scheduling_policy="priority"`; a part's priority is its owner's
    samples in the engine (lower first, ties in arrival order), so a lightly loaded owner
    goes ahead of a heavy one's waiting parts. Event-loop thread only."""

    def __init__(self) -> None:
        self.samples: dict[str, int] = {}
        self.waiting = 0  # parts waiting for their owner's room
        self._room: asyncio.Condition | None = None

    def priority(self, owner: str) -> int:
        return self.samples.get(owner, 0)

    @contextlib.asynccontextmanager
    async def admit(self, owner: str, n: int, cap: int):
        if self._room is None:
            self._room = asyncio.Condition()
        async with self._room:
            self.waiting += 1
            try:
                await self._room.wait_for(lambda: self.samples.get(owner, 0) == 0 or self.samples[owner] + n <= cap)
            finally:
                self.waiting -= 1
            self.samples[owner] = self.samples.get(owner, 0) + n
        try:
            yield
        finally:
            async with self._room:
                left = self.samples[owner] - n
                if left:
                    self.samples[owner] = left
                else:
                    del self.samples[owner]
                self._room.notify_all()


def _params(spec: ResolvedRequest, start: int = 0, size: int | None = None, cumulative: bool = False):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    no_stop = spec.request.sampling_params.stop is not None and not spec.stop_token_ids and not spec.stop_strings
    return SamplingParams(
        n=size or (1 if is_greedy(spec) else spec.num_samples), max_tokens=spec.max_tokens,
        temperature=0.0 if is_greedy(spec) else spec.temperature,
        top_k=0 if spec.top_k == -1 else spec.top_k, top_p=spec.top_p, seed=(spec.seed + start) % _SEED_SPAN,
        stop=list(spec.stop_strings) or None, stop_token_ids=list(spec.stop_token_ids) or None,
        ignore_eos=no_stop, include_stop_str_in_output=True, logprobs=spec.topk_sample_logprobs,
        skip_special_tokens=True,
        # a streamed or followed request sees every step's output (whole so far: the last one is the final)
        output_kind=RequestOutputKind.CUMULATIVE if cumulative else RequestOutputKind.FINAL_ONLY,
    )


def _stream_part(output, spec: ResolvedRequest, start: int, sent: dict[int, int]) -> None:
    """Hand `on_tokens` what each completion of a cumulative output drew since the last one
    (greedy: vLLM's one completion is every sample's, see `_response`)."""
    for completion in output.outputs:
        index = completion.index + start
        tokens = [int(t) for t in completion.token_ids]
        first = sent.get(index, 0)
        if len(tokens) <= first:
            continue
        entries = completion.logprobs or []
        logprobs = [entries[i][tokens[i]].logprob if i < len(entries) else float("nan")
                    for i in range(first, len(tokens))]
        sent[index] = len(tokens)
        for sample in range(spec.num_samples) if is_greedy(spec) else [index]:
            spec.request.on_tokens(sample, tokens[first:], logprobs)


def _lora_request(version: VLLMWeightVersion | None):
    if version is None or not version.is_lora:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=f"ember-{version.lora_id}", lora_int_id=version.lora_id,
                       lora_path=str(version.path))


def _topk_row(entry, k: int) -> tuple[np.ndarray, np.ndarray]:
    ranked = sorted((lp.rank, tok, lp.logprob) for tok, lp in entry.items() if lp.rank is not None and lp.rank <= k)
    return np.array([t for _, t, _ in ranked], np.int64), np.array([v for *_, v in ranked], np.float32)


def _sequence(completion, spec: ResolvedRequest, sequence_id: str) -> types.SampledSequence:
    tokens = np.asarray(list(completion.token_ids), np.int64)
    entries = completion.logprobs or []
    logprobs = np.array([entries[i][int(t)].logprob for i, t in enumerate(tokens)], np.float32)
    k = spec.topk_sample_logprobs
    rows = [_topk_row(entries[i], k) for i in range(len(tokens))] if k > 0 else None
    return sampled_sequence(tokens, logprobs, rows, k, completion.finish_reason == "stop", sequence_id)


@dataclass
class _Merged:
    """The parts of one request as one output (what `_response` reads); `spans`: a followed
    request's version spans by sample index (None: not followed)."""

    outputs: list
    num_cached_tokens: int
    spans: dict[int, list] | None = None


def _merged(parts: list) -> _Merged:
    """`parts`: (final output, first sample index, FollowedPart or None) per part."""
    spans = None
    if any(part is not None for _, _, part in parts):
        spans = {start + i: s for _, start, part in parts for i, s in part.spans.items()}
    return _Merged([c for final, _, _ in parts for c in final.outputs], int(parts[0][0].num_cached_tokens or 0), spans)


def _response(final, spec: ResolvedRequest) -> types.SampleResponse:
    if final is None:
        raise RuntimeError("the vLLM engine returned no output for the request")
    completions = sorted(final.outputs, key=lambda c: c.index)
    if is_greedy(spec):  # vLLM refuses n > 1 for greedy decoding; the n samples are the same argmax path
        completions = completions[:1] * spec.num_samples
    sequences = [_sequence(c, spec, spec.sequence_ids[i]) for i, c in enumerate(completions)]
    spans = getattr(final, "spans", None)
    if spans is not None:
        sequences = [with_spans(seq, spans[c.index]) for seq, c in zip(sequences, completions)]
    return types.SampleResponse(sequences=sequences, prompt_cache_hit_tokens=int(final.num_cached_tokens or 0))


def _empty_response(spec: ResolvedRequest) -> types.SampleResponse:
    empty = np.zeros(0, np.int64)
    k = spec.topk_sample_logprobs
    return types.SampleResponse(sequences=[
        sampled_sequence(empty, np.zeros(0, np.float32), [] if k else None, k, False, sid)
        for sid in spec.sequence_ids
    ])
