"""Per-rank memory of one training engine, estimated before anything is allocated.

`estimate_memory(model_dir, engine=..., parallel=..., tokens=N, lora_rank=R)` builds the
model on the meta device (shapes only: a Qwen3-32B config answers in seconds and a
directory holding only `config.json` is enough), counts what each rank of the
`ParallelismConfig` holds — by arithmetic on the layout, no process group — and adds the
activations of one micro-batch of N tokens:

* parameters: every tensor in the stored dtype; decoder-layer projections divided by `tp`,
  and an untied `lm_head` too (ember's TP plan splits it by vocabulary rows, ceil(V/tp)
  per rank; embeddings, norms and a tied `lm_head` stay replicated); everything divided by
  `dp_shard * cp` (FSDP2; under context parallelism it shards over the flattened
  `(dp_shard, cp)` dims), plus FSDP2's working set: the root's unsharded tensors (embeddings,
  final norm, lm_head) and two unsharded layers (the one computing and the prefetched one).
* gradients: the trained tensors (the adapter's for LoRA) in the stored dtype, sharded alike.
* optimizer: AdamW two moments, Dimuon one momentum per trained tensor; 0 on the device with
  `optimizer_offload` (reported as host memory).
* activations: what autograd saves per token and decoder layer, measured on transformers'
  Llama/Qwen3 layers with sdpa (fp32; `saved_bytes_per_token` below), the packed
  block-diagonal mask, and the output head: ~3.4 (T, vocab) fp32 tensors unchunked, as
  many (chunk, vocab) tensors chunked (`EngineConfig.logprob_chunk_tokens`), the vocabulary
  being this rank's ceil(V/tp) share when TP splits lm_head. With activation
  checkpointing one hidden state per layer plus one layer's activations; with activation
  offload the saved tensors go to the host and only one layer's stay on the device.
* context parallelism (`cp`): each rank runs the decoder and the output head on
  `ceil(N / cp)` tokens; the (T, T) attention mask stays full-size on every rank (Ulysses
  attention sees the whole sequence for its heads).
* peak: all of the above (gradients and saved activations coexist during backward).
* the sampler's slot cache for one sequence of N tokens (beside the peak, not in it: the
  TorchSampler's memory, `sampler_cache_bytes`): keys and values per token of each
  full-attention layer, and for a linear-attention layer (Qwen3.5's Gated DeltaNet) its
  fixed recurrent state instead, whatever N. A model with linear-attention layers is not
  packed (`TorchEngine`), so it gets no (T, T) packing mask; its linear layers' saved
  activations are counted with the attention layers' fit (not measured for them).

A mixture-of-experts model (docs/architecture.md#mixture-of-experts) also reports its total
and active parameters (`parameter_counts`: k of E experts per token); its adapter counts
rank x (in + out) per expert of each adapted expert weight, and its activations take the
k routed experts' width for the MLP's. Under expert parallelism (`ep`) each rank holds
E/ep experts per layer (`experts_per_rank`): the experts modules' tensors, their
gradients and moments, and an expert adapter's A factors (expert-major) are divided by
`ep` instead of `dp_shard`, and left out of FSDP2's unsharded working set; an expert
adapter's B factors stay whole on every rank (ember.engine.expert_parallel). The
all-to-all dispatch holds, for the layer computing, four (T x k, hidden) buffers in the
compute dtype (rows sent, received, the experts' outputs, rows returned): `dispatch_buffers`.

The model on the meta device is built by transformers (`AutoModelForCausalLM.from_config`),
the LoRA adapter's size by arithmetic on the target Linear shapes (`lora_target_modules`).
The CPU figures are checked against measured peaks in tests/engine/test_engine_estimate.py.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tinker import types

from ember.engine.config import EngineConfig
from ember.engine.parallel import ParallelismConfig, shards_vocab
from ember.models.loading import resolve_dtype

GiB = 1024**3
_NORM_FP32 = 4  # RMSNorm computes in fp32 whatever the model dtype (transformers' Llama/Qwen3)


@dataclass
class MemoryEstimate:
    """Bytes per rank (device memory unless named host)."""

    tokens: int
    world_size: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    output_head: int
    fsdp_working_set: int = 0
    host_offloaded: int = 0
    notes: list[str] = field(default_factory=list)
    sampler_kv: int = 0  # one sequence of `tokens` in the sampler: full-attention layers' keys and values
    sampler_state: int = 0  # ... and linear-attention layers' recurrent state (no KV)
    total_parameters: int = 0  # the model's parameter count (elements)
    active_parameters: int = 0  # of them, those one token computes with (k of E experts; all for a dense model)
    experts_per_rank: int = 0  # a mixture-of-experts model's experts per layer on each rank (E / ep); 0 if dense
    dispatch_buffers: int = 0  # expert parallelism's all-to-all buffers of one layer

    @property
    def peak(self) -> int:
        return (self.parameters + self.gradients + self.optimizer + self.activations + self.output_head
                + self.fsdp_working_set + self.dispatch_buffers)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "peak": self.peak}

    def lines(self) -> list[str]:
        rows = [("parameters", self.parameters), ("gradients", self.gradients), ("optimizer state", self.optimizer),
                ("activations", self.activations), ("output head (logits)", self.output_head)]
        if self.fsdp_working_set:
            rows.append(("FSDP2 unsharded working set", self.fsdp_working_set))
        if self.dispatch_buffers:
            rows.append(("expert all-to-all buffers", self.dispatch_buffers))
        rows.append(("peak", self.peak))
        if self.host_offloaded:
            rows.append(("host memory (offloaded)", self.host_offloaded))
        out = [f"per rank (world size {self.world_size}), one micro-batch of {self.tokens} tokens:"]
        out += [f"  {name:<30} {_gib(n)}" for name, n in rows]
        if self.active_parameters != self.total_parameters:
            out.append(f"  {'model parameters':<30} {self.total_parameters / 1e9:10.3f} B total, "
                       f"{self.active_parameters / 1e9:.3f} B active per token, "
                       f"{self.experts_per_rank} experts per layer on each rank")
        out += [f"sampler slot cache, one sequence of {self.tokens} tokens (not in the peak):",
                f"  {'KV cache (attention layers)':<30} {_gib(self.sampler_kv)}"]
        if self.sampler_state:
            out.append(f"  {'state (linear-attn layers)':<30} {_gib(self.sampler_state)}")
        return out + [f"  note: {n}" for n in self.notes]


def _gib(n: int) -> str:
    return f"{n / GiB:10.3f} GiB  ({n:,} bytes)"


def load_config(model_dir: str | os.PathLike):
    """The transformers config of a model directory (only `config.json` is read)."""
    from transformers import AutoConfig

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"{str(path)!r} has no config.json; pass a model directory")
    return AutoConfig.from_pretrained(path, local_files_only=True)


def meta_model(hf_config) -> torch.nn.Module:
    """The causal LM of `hf_config` with every tensor on the meta device (no memory); a
    vision-language model's own class (`ember.models.loading.model_class`), tower included."""
    from transformers import AutoModelForCausalLM

    from ember.models.loading import model_class

    cls = model_class(hf_config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config) if cls is AutoModelForCausalLM else cls(hf_config)


@dataclass
class _Counts:
    """Elements per rank, before the dtype."""

    layer: int  # decoder layers, after TP
    root: int  # embeddings, final norm, lm_head (its rows divided by tp when TP splits it)
    largest_layer: int
    trained: int


def _vocab_rows(rows: int, tp: int, split: bool) -> int:
    """Rows of lm_head (or of its output) one rank holds: ceil(V / tp) when TP splits it."""
    from ember.engine.vocab_parallel import shard_rows

    return shard_rows(rows, tp) if split else rows


def _count(model: torch.nn.Module, tp: int, lora_rank: int | None, lora: types.LoraConfig | None,
           split: bool = False) -> _Counts:
    layer = root = 0
    per_layer: dict[str, int] = {}
    out = model.get_output_embeddings()
    for name, p in model.named_parameters():  # tied weights are listed once
        if ".layers." in name:
            n = p.numel() // tp if p.dim() == 2 else p.numel()  # projections split; norms replicated
            layer += n
            key = name.split(".layers.")[1].split(".")[0]
            per_layer[key] = per_layer.get(key, 0) + n
        elif out is not None and p is out.weight:
            root += _vocab_rows(p.shape[0], tp, split) * p.shape[1]
        else:
            root += p.numel()
    trained = layer + root if lora is None else _lora_elements(model, lora, tp, split)
    return _Counts(layer, root, max(per_layer.values(), default=0), trained)


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(total, active) parameters: a mixture-of-experts model's expert weights count
    k / E of their elements as active (each token computes with k of the E experts); every
    other parameter, and every parameter of a dense model, is active."""
    from ember.models.families import moe_of

    layout = moe_of(model.config)
    total = active = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if layout is not None and p.dim() == 3 and f".{layout.experts}." in f".{name}":
            cfg = model.config
            active += p.numel() * int(getattr(cfg, layout.top_k)) // int(getattr(cfg, layout.num_experts))
        else:
            active += p.numel()
    return total, active


def _expert_lora_elements(model: torch.nn.Module, lora: types.LoraConfig) -> int:
    """A mixture-of-experts adapter's factors: rank x (in + out) for every expert of every
    adapted fused weight (`ember.models.experts.factor_shapes`)."""
    return sum(_expert_lora_factors(model, lora))


def _expert_lora_factors(model: torch.nn.Module, lora: types.LoraConfig) -> tuple[int, int]:
    """(A, B) elements of a mixture-of-experts adapter's expert factors."""
    from ember.models.experts import factor_shapes
    from ember.models.families import moe_of
    from ember.models.lora import lora_target_parameters

    layout, wanted = moe_of(model.config), lora_target_parameters(model, lora)
    a_total = b_total = 0
    for name, p in model.named_parameters():
        if layout is not None and p.dim() == 3 and any(name.endswith("." + w) for w in wanted):
            a, b = factor_shapes(tuple(p.shape), lora.rank, layout.transposed)
            a_total, b_total = a_total + a[0] * a[1], b_total + b[0] * b[1]
    return a_total, b_total


@dataclass
class _ExpertSplit:
    """Elements that expert parallelism divides by ep (instead of dp_shard)."""

    params: int = 0  # the experts modules' tensors
    largest_layer: int = 0  # of them, one layer's (the most of any layer)
    trained: int = 0  # what trains of them: the tensors (full) or the adapters' A factors (LoRA)
    experts_per_rank: int = 0


def expert_split(model: torch.nn.Module, lora: types.LoraConfig | None, ep: int) -> _ExpertSplit:
    """What `ep` ranks split of a mixture-of-experts `model` (nothing for a dense model)."""
    from ember.models.families import moe_of

    layout = moe_of(model.config)
    if layout is None:
        return _ExpertSplit()
    experts = int(getattr(model.config, layout.num_experts))
    if ep == 1:
        return _ExpertSplit(experts_per_rank=experts)
    per_layer: dict[str, int] = {}
    for name, p in model.named_parameters():
        if f".{layout.experts}." in f".{name}" and ".layers." in name:
            key = name.split(".layers.")[1].split(".")[0]
            per_layer[key] = per_layer.get(key, 0) + p.numel()
    total = sum(per_layer.values())
    trained = total if lora is None else _expert_lora_factors(model, lora)[0]
    return _ExpertSplit(total, max(per_layer.values(), default=0), trained, experts // ep)


def dispatch_bytes(hf_config, tokens: int, compute_bytes: int, ep: int) -> int:
    """Expert parallelism's all-to-all buffers for one layer: rows sent, received, the
    experts' outputs and the rows returned, each (tokens x k, hidden) (balanced routing)."""
    from ember.models.families import moe_of

    layout = moe_of(hf_config)
    if layout is None or ep == 1:
        return 0
    return 4 * tokens * int(getattr(hf_config, layout.top_k)) * int(hf_config.hidden_size) * compute_bytes


def _lora_elements(model: torch.nn.Module, lora: types.LoraConfig, tp: int, vocab_split: bool = False) -> int:
    from ember.models.lora import lora_target_modules

    targets = set(lora_target_modules(model, lora))
    out = model.get_output_embeddings()
    rowwise = _rowwise_paths(model)
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            if module is out:  # B has the vocabulary's rows
                total += lora.rank * (module.in_features + _vocab_rows(module.out_features, tp, vocab_split))
            elif ".layers." not in name:
                total += lora.rank * (module.in_features + module.out_features)
            elif any(name.endswith("." + path) for path in rowwise):  # A split by its input columns, B whole
                total += lora.rank * (module.in_features // tp + module.out_features)
            else:  # column split: A whole, B split by its output rows
                total += lora.rank * (module.in_features + module.out_features // tp)
    return total + _expert_lora_elements(model, lora)


def _rowwise_paths(model: torch.nn.Module) -> tuple[str, ...]:
    """The decoder-layer paths TP splits by input columns (o_proj, down_proj, ...): the
    family's `tp_plan` (`ember.models.families`); none when the family has no plan."""
    from ember.models.families import family_of

    family = family_of(model.config)
    return tuple(family.tp_plan.rowwise) if family is not None and family.tp_plan is not None else ()


def _mlp_width(text) -> int:
    """The MLP columns one token goes through: the dense MLP's, or k experts' (a
    mixture-of-experts layer; its router's E logits and softmax are counted with them)."""
    from ember.models.families import moe_of

    layout = moe_of(text)
    if layout is None:
        return int(text.intermediate_size)
    width = int(getattr(text, "moe_intermediate_size", None) or text.intermediate_size)
    shared = int(getattr(text, "shared_expert_intermediate_size", None) or 0)  # Qwen3.5-MoE's dense shared expert
    return int(getattr(text, layout.top_k)) * width + shared + int(getattr(text, layout.num_experts)) // 2


def _routed_copies(text) -> int:
    """Elements per token a mixture-of-experts layer saves beyond a dense MLP's: transformers'
    expert loop keeps, for each of the token's k experts, the gathered copy of its hidden
    state (the experts' matmul input) and that expert's output (multiplied by its routing
    weight afterwards): 2·k·H. Measured with saved-tensor hooks on fp32 Qwen3-MoE layers
    (H 256; E 8, k 2 and E 16, k 4): the fit plus these 2.9% and 3.1% above the measured."""
    from ember.models.families import moe_of

    layout = moe_of(text)
    return 0 if layout is None else 2 * int(getattr(text, layout.top_k)) * int(text.hidden_size)


# families whose attention normalises each query and key head (Qwen3's q_norm / k_norm)
def saved_bytes_per_token(hf_config, compute_bytes: int, tp: int = 1) -> int:
    """Bytes autograd keeps per token for one decoder layer (transformers' Llama/Qwen3, sdpa).

    Fitted on saved-tensor hooks over fp32 Llama and Qwen3 layers of several shapes (exact
    to ±0.3% there): 7·H (two RMSNorms: input, normalised, product, residual) + 4·I (gate,
    SiLU, up, product) + 2·q + 2·kv (rotary, attention output) elements, Qwen3's per-head
    q/k norms another 2·q + 2·kv; heads and MLP columns divided by `tp`. A
    mixture-of-experts layer's I is the k routed experts' columns (and a shared expert's,
    `_mlp_width`), plus the routed copies of the token (`_routed_copies`), and Qwen3-MoE
    has Qwen3's q/k norms."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    h, i = int(text.hidden_size), _mlp_width(text) // tp
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or h // heads)
    q = heads * head_dim // tp
    kv = int(getattr(text, "num_key_value_heads", None) or heads) * head_dim // tp
    per_elem = 7 * h + 4 * i + 2 * q + 2 * kv + 2 * heads // tp + _routed_copies(text)
    if _per_head_qk_norm(text):
        per_elem += 2 * q + 2 * kv
    norm_extra = 4 * h * max(_NORM_FP32 - compute_bytes, 0)  # fp32 copies inside the norms of a bf16 model
    return per_elem * compute_bytes + norm_extra


def _per_head_qk_norm(text_config) -> bool:
    """Whether the family normalises each query and key head (Qwen3's `q_norm` / `k_norm`),
    as its file declares it (`DirectDecode.qk_norm`, or `ModelFamily.head_qk_norm` for a
    family without direct decode)."""
    from ember.models.families import family_of

    family = family_of(text_config)
    if family is None:
        return False
    return family.head_qk_norm or (family.decode is not None and family.decode.qk_norm == "head")


def sampler_cache_bytes(hf_config, tokens: int, dtype_bytes: int) -> tuple[int, int]:
    """(KV bytes, recurrent-state bytes) one sequence of `tokens` tokens holds in the
    TorchSampler's slot cache (`ember.sampling.kv_cache`): a full-attention layer keeps a key
    and a value per KV head per token; a linear-attention layer keeps, whatever the length,
    the short convolution's last `linear_conv_kernel_dim` inputs of q/k/v (model dtype) and
    the delta-rule matrix per value head, key dim x value dim (fp32, as transformers'
    kernels return it)."""
    from ember.models.families import linear_attention_layers

    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    layers, linear = int(text.num_hidden_layers), len(linear_attention_layers(text))
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or int(text.hidden_size) // heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    kv = (layers - linear) * 2 * kv_heads * head_dim * tokens * dtype_bytes
    if not linear:
        return kv, 0
    hk, hv = int(text.linear_num_key_heads), int(text.linear_num_value_heads)
    dk, dv = int(text.linear_key_head_dim), int(text.linear_value_head_dim)
    conv = (2 * hk * dk + hv * dv) * int(text.linear_conv_kernel_dim) * dtype_bytes
    return kv, linear * (conv + hv * dk * dv * 4)


def _activations(hf_config, engine: EngineConfig, tp: int, tokens: int, compute_bytes: int,
                 cp: int = 1) -> tuple[int, int, list]:
    """(device bytes, host bytes, notes) of the decoder's saved activations for `tokens`
    (this rank's `ceil(tokens / cp)` of them under context parallelism)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    layers, hidden = int(text.num_hidden_layers), int(text.hidden_size)
    mask = 0
    from ember.models.families import linear_attention_layers

    packed = engine.packing and not linear_attention_layers(text)  # TorchEngine does not pack those
    if packed and not engine.attn_implementation.startswith("flash"):
        mask = 5 * tokens * tokens  # sdpa's block-diagonal mask: bool + fp32 additive, (T, T), full size under cp
    tokens = -(-tokens // cp)
    per_layer = saved_bytes_per_token(hf_config, compute_bytes, tp) * tokens
    notes = []
    if mask:
        notes.append(f"packed sdpa attention builds a (T, T) mask: {_gib(mask).strip()}; flash_attention_2 does not")
    final = 3 * hidden * compute_bytes * tokens  # final norm
    if engine.activation_checkpointing:
        saved = layers * hidden * compute_bytes * tokens + per_layer  # layer inputs + one layer recomputed
    else:
        saved = layers * per_layer
    if engine.activation_offload:
        return per_layer + mask + final, saved, notes + ["activation offload: saved tensors in host memory"]
    return saved + mask + final, 0, notes


def _output_head(hf_config, engine: EngineConfig, tokens: int, compute_bytes: int, tp: int = 1,
                 split: bool = False) -> int:
    """(rows, vocab) tensors of the policy head: logits, fp32 log-softmax and their gradients,
    over all T or one chunk. Measured on CPU (fp32): ~3.4 vocabulary-wide fp32 tensors per
    row at the peak (the logits are freed before their gradient is made). With `split`
    (TP splits lm_head) the vocabulary is this rank's ceil(V / tp) rows."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    vocab, hidden = _vocab_rows(int(text.vocab_size), tp, split), int(text.hidden_size)
    chunk = engine.logprob_chunk_tokens
    rows = tokens if chunk == 0 else min(chunk, tokens)
    per_row = vocab * (compute_bytes + 19 * 4 // 8)
    kept = 0 if chunk == 0 else hidden * compute_bytes * tokens  # the hidden state the chunks read
    return rows * per_row + kept


def estimate_memory(
    model_dir: str | os.PathLike | None = None,
    *,
    hf_config=None,
    engine: EngineConfig | None = None,
    parallel: ParallelismConfig | None = None,
    tokens: int,
    lora_rank: int | None = None,
    optimizer: str = "adamw",
    meta: torch.nn.Module | None = None,
) -> MemoryEstimate:
    """The per-rank `MemoryEstimate` of training `model_dir` (or `hf_config`) with these settings
    (`meta`: the model already built by `meta_model`, to estimate several settings at once)."""
    engine = engine or EngineConfig()
    parallel = parallel or ParallelismConfig()
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be an integer >= 1, got {tokens!r}")
    if optimizer not in ("adamw", "dimuon"):
        raise ValueError(f"optimizer must be 'adamw' or 'dimuon', got {optimizer!r}")
    hf_config = hf_config if hf_config is not None else load_config(model_dir)
    lora = types.LoraConfig(rank=lora_rank) if lora_rank else None
    model = meta if meta is not None else meta_model(hf_config)
    split = shards_vocab(model, parallel.tp)
    counts = _count(model, parallel.tp, lora_rank, lora, split)
    param_bytes = resolve_dtype(engine.dtype).itemsize
    compute_bytes = resolve_dtype(engine.autocast_dtype or engine.dtype).itemsize
    shard, ep = parallel.dp_shard * parallel.cp, parallel.ep
    experts = expert_split(model, lora, ep)
    params = (counts.layer + counts.root - experts.params) * param_bytes // shard + experts.params * param_bytes // ep
    # FSDP2 shards the adapter too; the experts' part is split over ep instead
    trained = (counts.trained - experts.trained) * param_bytes // shard + experts.trained * param_bytes // ep
    moments = {"adamw": 2, "dimuon": 1}[optimizer] * trained
    working = (counts.root + 2 * (counts.largest_layer - experts.largest_layer)) * param_bytes if shard > 1 else 0
    acts, host_acts, notes = _activations(hf_config, engine, parallel.tp, tokens, compute_bytes, parallel.cp)
    if ep > 1:
        notes.append(f"expert parallelism: each rank holds {experts.experts_per_rank} experts per layer "
                     f"(ep={ep}); tokens reach them by all-to-all")
    if parallel.cp > 1:
        notes.append(f"context parallelism: each rank holds {-(-tokens // parallel.cp)} of the {tokens} tokens")
    host = host_acts + (moments if engine.optimizer_offload else 0)
    sampler_kv, sampler_state = sampler_cache_bytes(hf_config, tokens, param_bytes)
    total, active = parameter_counts(model)
    return MemoryEstimate(
        tokens=tokens, world_size=parallel.world_size, parameters=params, gradients=trained,
        optimizer=0 if engine.optimizer_offload else moments, activations=acts,
        output_head=_output_head(hf_config, engine, -(-tokens // parallel.cp), compute_bytes, parallel.tp, split),
        fsdp_working_set=working,
        host_offloaded=host, notes=notes, sampler_kv=sampler_kv, sampler_state=sampler_state,
        total_parameters=total, active_parameters=active, experts_per_rank=experts.experts_per_rank,
        dispatch_buffers=dispatch_bytes(hf_config, tokens, compute_bytes, ep),
    )


def longest_datum(fits_bytes: int, step: int = 256, limit: int = 1 << 21, **kwargs) -> int:
    """The most tokens (a multiple of `step`) whose estimated peak is within `fits_bytes`; 0 if none."""
    if "model_dir" in kwargs:
        kwargs["hf_config"] = load_config(kwargs.pop("model_dir"))
    kwargs.setdefault("meta", meta_model(kwargs["hf_config"]))
    lo, hi = 0, limit // step
    while lo < hi:  # the peak grows with the tokens: bisect
        mid = (lo + hi + 1) // 2
        if estimate_memory(tokens=mid * step, **kwargs).peak <= fits_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo * step


# ---------------------------------------------------------------------- ember serve's start-up check
def available_memory(device: str) -> int:
    """Bytes one rank may use: free memory of the CUDA device, or the host's MemAvailable."""
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def check_fits(models: dict[str, str | os.PathLike], engine: EngineConfig, parallel: ParallelismConfig | None,
               log=None, available: int | None = None, reserved: int = 0) -> None:
    """`ember serve`'s start-up check: log each model's estimate for one micro-batch of
    `engine.micro_batch_tokens` tokens (a LoRA rank-32 run and full fine-tuning) and raise
    ValueError, with the numbers, when even the smallest run (LoRA rank 1) cannot fit in
    `available` bytes (default: `available_memory`; on the CPU every rank shares the host),
    less the `reserved` bytes a sampler beside the trainer takes (vLLM's memory share)."""
    parallel = parallel or ParallelismConfig()
    avail = (available_memory(engine.device) if available is None else available) - reserved
    beside = f" beside the sampler ({reserved / GiB:.2f} GiB)" if reserved else ""
    share = parallel.world_size if not engine.device.startswith("cuda") else 1
    for name, directory in models.items():
        try:  # advisory for what cannot be estimated: the run that names it gets the loading error
            smallest = _log_estimates(name, directory, engine, parallel, log)
        except Exception as exc:  # noqa: BLE001 (an unknown architecture must not stop ember serve)
            if log is not None:
                log(f"memory estimate for {name}: skipped ({type(exc).__name__}: {exc})")
            continue
        if smallest.peak * share > avail:
            raise ValueError(
                f"model {name!r} does not fit: one micro-batch of {engine.micro_batch_tokens} tokens needs an "
                f"estimated {smallest.peak / GiB:.2f} GiB per rank x {share} rank(s) even as a LoRA rank-1 run "
                f"(parameters {smallest.parameters / GiB:.2f}, activations {smallest.activations / GiB:.2f}, "
                f"output head {smallest.output_head / GiB:.2f} GiB), and {avail / GiB:.2f} GiB is available on "
                f"{engine.device}{beside}; lower --engine.micro_batch_tokens, set --engine.logprob_chunk_tokens / "
                "--engine.activation_checkpointing, or shard with --parallel.* (see `ember estimate`)")


def _log_estimates(name: str, directory, engine: EngineConfig, parallel: ParallelismConfig, log) -> MemoryEstimate:
    """Log a LoRA rank-32 and a full fine-tuning estimate; return the smallest run's (LoRA rank 1)."""
    hf_config = load_config(directory)
    common = dict(hf_config=hf_config, engine=engine, parallel=parallel, tokens=engine.micro_batch_tokens,
                  meta=meta_model(hf_config))
    if log is not None:
        for what, rank in (("LoRA rank 32", 32), ("full fine-tuning", None)):
            est = estimate_memory(lora_rank=rank, **common)
            log(f"memory estimate for {name} ({what}): " + "; ".join(x.strip() for x in est.lines()[1:]))
    return estimate_memory(lora_rank=1, **common)


# ---------------------------------------------------------------------- vLLM beside a trainer
VLLM_OWN_GPU_SHARE = 0.9  # vLLM's own default, on a GPU nothing else uses
CUDA_MARGIN_BYTES = 2 * GiB  # a CUDA context per process, the allocators' slack


def vllm_memory_share(total: int, trainer: int, *, shares_device: bool, margin: int = CUDA_MARGIN_BYTES) -> float:
    """vLLM's `gpu_memory_utilization` (a fraction of the GPU's `total` bytes): on a GPU of
    its own `VLLM_OWN_GPU_SHARE`; beside a trainer, what the trainer's `trainer` bytes and
    `margin` leave (at most that share). ValueError, with the numbers, when under 5 % is left."""
    if not shares_device:
        return VLLM_OWN_GPU_SHARE
    left = total - trainer - margin
    if left < 0.05 * total:
        raise ValueError(f"a vLLM sampler beside the trainer on one GPU of {total / GiB:.1f} GiB gets "
                         f"{max(left, 0) / GiB:.2f} GiB: the trainer takes an estimated {trainer / GiB:.2f} GiB "
                         f"and {margin / GiB:.1f} GiB is kept for CUDA; put the sampler on another GPU "
                         "(--sampler.device), colocate them (--sampler.colocate), or set "
                         "--sampler.gpu_memory_utilization")
    return round(min(VLLM_OWN_GPU_SHARE, left / total), 3)


def trainer_bytes_beside_sampler(model_dir: str | os.PathLike, engine: EngineConfig, colocate: bool) -> int:
    """What the trainer holds on its GPU while a sampler beside it runs: colocated (the trainer
    is offloaded while vLLM samples) the base model's parameters, which a LoRA run keeps on
    the device; else its whole estimated peak for a LoRA rank-32 run of one micro-batch."""
    est = estimate_memory(model_dir, engine=engine, tokens=engine.micro_batch_tokens, lora_rank=32)
    return est.parameters if colocate else est.peak
