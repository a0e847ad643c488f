"""A direct decode forward for the model families that declare one (`ember.models.families`:
Llama, Mistral, Qwen2, Qwen3, OLMo 2).

Sampling runs one forward per generated token over a few dozen rows; for small and
medium models on CPU most of that forward's time is Python overhead in the general
transformers call path (output capturing, mask preparation, attention dispatch, keyword
plumbing), not arithmetic. `DirectDecoder` computes the same function from the same
parameters with plain tensor ops: embedding, per layer the family's layer function
(`DirectDecode.layer`: where the RMSNorms sit) over the operations here: attention is
q/k/v (+ the family's q/k norm, per head or over the projection) -> rotary (the model's
own rotary module) -> `SlotCache` update -> SDPA -> o_proj, the MLP is gated (the
config's activation); then the final norm and lm_head.

It reads weights from the model, or from a full fine-tuning version's tensors, and adds
LoRA deltas itself (the same expression as the forward hooks), so versions behave
exactly as in the transformers path. The model is not modified. Architectures outside
the list, or configurations it does not reproduce (sliding windows, non-gated MLPs),
use the transformers forward (`unsupported_reason` says why). Agreement with the
transformers forward is tested (tests/sampling/test_sampling_decoder.py).

With `SamplerConfig.compile`, a decode step's `DecodeKernels` (the tensor-only parts of a
layer) run compiled; see `compiled_kernels` (tests/sampling/test_sampling_compile.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from ember.models.families import direct_decode_families, family_of, uses_sliding_window
from ember.sampling.kv_cache import SlotCache
from ember.sampling.weights import LoraDelta, add_lora

LoraPlan = dict[str, list[tuple[torch.Tensor | None, LoraDelta]]]
log = logging.getLogger(__name__)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with `sin` pre-signed (see `_Rope`)."""
    return x * cos + x.roll(half, dims=-1) * sin


def attend(q: torch.Tensor, k3: torch.Tensor, v3: torch.Tensor, bias: torch.Tensor, scaling: float) -> torch.Tensor:
    """One query position per row over its KV rows: softmax(q k^T * scaling + bias) v, the
    softmax in fp32 ([rows, g, d] queries, [rows, kv, d] keys and values)."""
    scores = torch.bmm(q, k3.transpose(1, 2)) * scaling + bias
    return torch.bmm(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v3)


@dataclass(frozen=True)
class DecodeKernels:
    """The parts of a direct decode step that take tensors only (no weights lookup, no
    LoRA, no cache write): RMSNorm, rotary, the attention core and the gated activation.
    `SamplerConfig.compile` runs them compiled (`compiled_kernels`); the linears (with
    their LoRA deltas) and the slot-cache write stay eager around them."""

    norm: Callable
    rope: Callable
    attend: Callable
    gate: Callable


def eager_kernels(rms_norm: Callable, act: Callable) -> DecodeKernels:
    def gate(g: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return act(g) * up

    return DecodeKernels(rms_norm, rope, attend, gate)


def compiled_kernels(eager: DecodeKernels, stats) -> DecodeKernels:
    """`eager`'s functions through `CompileStats.compiled` (`ember.engine.compile`: inductor,
    `dynamic=True`, each graph counted): a new batch size or KV length is a symbolic size,
    not a new graph (torch specialises sizes 0 and 1, so one row and several compile apart)."""
    return DecodeKernels(*(stats.compiled(f) for f in (eager.norm, eager.rope, eager.attend, eager.gate)))


def unsupported_reason(model: nn.Module) -> str | None:
    """None when `DirectDecoder` reproduces this model's forward, else why not."""
    cfg = model.config
    family = family_of(cfg)
    if family is None or not family.direct_decode:
        return f"model_type {cfg.model_type!r} is not one of {direct_decode_families()}"
    if uses_sliding_window(cfg):
        return "sliding-window attention"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or not hasattr(model, "lm_head") or not hasattr(inner, "rotary_emb"):
        return "not a <Model>ForCausalLM with .model.layers, .model.rotary_emb and .lm_head"
    mlp = layers[0].mlp
    if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return "the MLP is not gated (gate_proj/up_proj/down_proj)"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    return None


class DirectDecoder:
    """Computes `model(input_ids, position_ids, mask, past_key_values=cache).logits`."""

    def __init__(self, model: nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"DirectDecoder: {reason}")
        cfg = model.config
        self.model = model
        self.family = family_of(cfg).decode  # the layer, q/k norm and RMSNorm of this family
        attn = model.model.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.kv_groups = attn.num_key_value_groups
        self.kv_heads = cfg.num_key_value_heads
        self.eps = cfg.rms_norm_eps
        self.act = ACT2FN[cfg.hidden_act]
        self.eager = eager_kernels(self.family.rms_norm, self.act)
        self.compiled: DecodeKernels | None = None  # `use_compiled`
        self.compile_stats = None
        self.num_layers = len(model.model.layers)
        # Every name (tied aliases too) -> the model's tensor, and -> the canonical name a
        # full fine-tuning version keys its tensors by (see weights.parameter_aliases).
        self.base = dict(model.named_parameters(remove_duplicate=False))
        first: dict[int, str] = {}
        self.canonical = {n: first.setdefault(id(t), n) for n, t in self.base.items()}

    def use_compiled(self, stats) -> None:
        """Run decode steps (one token per row) through compiled kernels (`compiled_kernels`,
        counted in `stats`, an `ember.engine.compile.CompileStats`); prefills stay eager."""
        self.compile_stats = stats
        self.compiled = compiled_kernels(self.eager, stats)

    def _kernels(self, decode: bool) -> DecodeKernels:
        if not decode or self.compiled is None:
            return self.eager
        if not self.compile_stats.compiled_layers:  # the first compiled step: say what it costs
            self.compile_stats.compiled_layers = self.num_layers
            log.info("sampler: compiling the decode step's kernels (%d decoder layers; inductor cache %s)",
                     self.num_layers, self.compile_stats.cache_dir)
        return self.compiled

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        cache: SlotCache,
        logits_to_keep: int,
        params: dict[str, torch.Tensor] | None = None,
        lora: LoraPlan | None = None,
        hidden: bool = False,
    ) -> torch.Tensor:
        """Logits [B, T', V] (T' = T if logits_to_keep == 0 else logits_to_keep); with
        `hidden`, the last hidden states [B, T', H] (after the final norm) instead."""
        w = _Weights(self.base, self.canonical, params or {}, lora or {})
        h = F.embedding(input_ids, w["model.embed_tokens.weight"])
        kernels = self._kernels(input_ids.shape[1] == 1)
        rope = _Rope(*self.model.model.rotary_emb(h, position_ids), kernels.rope)
        # Decode on CPU in fp32: folded-GQA batched matmuls (faster than SDPA's CPU kernel
        # there). Elsewhere SDPA, whose GPU kernels keep the scores in fp32 for bf16 models.
        bmm_decode = input_ids.shape[1] == 1 and h.device.type == "cpu" and h.dtype == torch.float32
        bias = self._decode_bias(mask, h.dtype) if bmm_decode else None
        ops = _LayerOps(self, w, rope, mask, bias, cache, kernels)
        for i in range(self.num_layers):
            h = self.family.layer(ops, h, i)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        h = kernels.norm(h, w["model.norm.weight"], self.eps)
        return h if hidden else w.linear(h, "lm_head")

    def _decode_bias(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The decode mask [B, 1, 1, kv] as an additive bias [B * kv_heads, 1, kv] (once per forward)."""
        mask = additive_mask(mask, dtype)
        b, kv = mask.shape[0], mask.shape[-1]
        return mask.expand(b, self.kv_heads, 1, kv).reshape(b * self.kv_heads, 1, kv)


class _LayerOps:
    """One forward's operations, for the family's layer function (`DecodeOps`)."""

    def __init__(self, dec: DirectDecoder, w: "_Weights", rope: "_Rope", mask, bias, cache: SlotCache,
                 kernels: DecodeKernels) -> None:
        self.dec, self.w, self.rope, self.mask, self.bias, self.cache = dec, w, rope, mask, bias, cache
        self.kernels = kernels

    def norm(self, x: torch.Tensor, i: int, name: str) -> torch.Tensor:
        return self.kernels.norm(x, self.w[f"model.layers.{i}.{name}.weight"], self.dec.eps)

    def mlp(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """The gated MLP: down(act(gate(x)) * up(x))."""
        m, w = f"model.layers.{i}.mlp.", self.w
        gate = self.kernels.gate(w.linear(x, m + "gate_proj"), w.linear(x, m + "up_proj"))
        return w.linear(gate, m + "down_proj")

    def attention(self, x: torch.Tensor, i: int) -> torch.Tensor:
        dec, w, prefix = self.dec, self.w, f"model.layers.{i}.self_attn."
        b, t, _ = x.shape
        shape = (b, t, -1, dec.head_dim)
        q, k = w.linear(x, prefix + "q_proj"), w.linear(x, prefix + "k_proj")
        v = w.linear(x, prefix + "v_proj").view(shape).transpose(1, 2)
        if dec.family.qk_norm == "projection":  # over all heads, before the split (OLMo 2)
            q, k = self.norm(q, i, "self_attn.q_norm"), self.norm(k, i, "self_attn.k_norm")
        q, k = q.view(shape), k.view(shape)
        if dec.family.qk_norm == "head":  # over each head (Qwen3)
            q, k = self.norm(q, i, "self_attn.q_norm"), self.norm(k, i, "self_attn.k_norm")
        # OLMo 2's rotary module returns fp32 cos/sin whatever the model dtype; its forward
        # casts the rotated q/k back (a no-op for the families whose cos/sin match q's dtype).
        q, k = self.rope(q.transpose(1, 2)).to(v.dtype), self.rope(k.transpose(1, 2)).to(v.dtype)
        k, v = self.cache.layers[i].update(k, v, i)
        o = self._decode_attention(q, k, v) if self.bias is not None else self._sdpa(q, k, v)
        return w.linear(o.transpose(1, 2).reshape(b, t, -1), prefix + "o_proj")

    def _decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One query position: the g query heads sharing a KV head become g query rows of it,
        so no KV head is copied, and two batched matmuls beat SDPA's blocked CPU kernel at
        this shape."""
        b, heads, _, d = q.shape
        rows = b * self.dec.kv_heads
        k3, v3 = k.reshape(rows, -1, d), v.reshape(rows, -1, d)
        return self.kernels.attend(q.reshape(rows, -1, d), k3, v3, self.bias, self.dec.scaling).view(b, heads, 1, d)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=self.dec.scaling,
                                              enable_gqa=self.dec.kv_groups > 1)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as 0 / dtype-min; an additive one unchanged."""
    if mask.dtype != torch.bool:
        return mask
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.finfo(dtype).min)


class _Weights:
    """Parameter lookup for one forward: a version's tensor if it has one, else the model's."""

    def __init__(self, base: dict[str, torch.Tensor], canonical: dict[str, str], params: dict[str, torch.Tensor],
                 lora: LoraPlan) -> None:
        self.base, self.canonical, self.params, self.lora = base, canonical, params, lora

    def __getitem__(self, name: str) -> torch.Tensor:
        if not self.params:
            return self.base[name]
        return self.params[self.canonical[name]]

    def linear(self, x: torch.Tensor, module: str) -> torch.Tensor:
        bias_name = module + ".bias"
        bias = self[bias_name] if bias_name in self.base else None
        out = F.linear(x, self[module + ".weight"], bias)
        entries = self.lora.get(module)
        return add_lora(out, x, entries) if entries else out


class _Rope:
    """Rotary embedding with the per-forward parts computed once for all layers:
    x * cos + rotate_half(x) * sin, with rotate_half(x) * sin = roll(x, d/2) * [-sin1, sin2]
    (the same products: negating a factor negates the product exactly)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, kernel: Callable = rope) -> None:
        half = cos.shape[-1] // 2
        self.half = half
        self.cos = cos.unsqueeze(1)
        self.sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)
        self.kernel = kernel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.cos, self.sin, self.half)
