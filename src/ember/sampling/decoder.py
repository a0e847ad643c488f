"""A direct decode forward for Llama-family models (Llama, Mistral, Qwen2, Qwen3).

Sampling runs one forward per generated token over a few dozen rows; for small and
medium models on CPU most of that forward's time is Python overhead in the general
transformers call path (output capturing, mask preparation, attention dispatch, keyword
plumbing), not arithmetic. `DirectDecoder` computes the same function from the same
parameters with plain tensor ops: embedding, per layer RMSNorm -> q/k/v (+ q/k norm for
Qwen3) -> rotary (the model's own rotary module) -> `SlotCache` update -> SDPA -> o_proj,
RMSNorm -> gated MLP (the config's activation), final norm, lm_head.

It reads weights from the model, or from a full fine-tuning version's tensors, and adds
LoRA deltas itself (the same expression as the forward hooks), so versions behave
exactly as in the transformers path. The model is not modified. Architectures outside
the list, or configurations it does not reproduce (sliding windows, non-gated MLPs),
use the transformers forward (`unsupported_reason` says why). Agreement with the
transformers forward is tested (tests/sampling/test_sampling_decoder.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from ember.models.families import direct_decode_families, family_of, uses_sliding_window
from ember.sampling.kv_cache import SlotCache
from ember.sampling.weights import LoraDelta, add_lora

LoraPlan = dict[str, list[tuple[torch.Tensor | None, LoraDelta]]]


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
        attn = model.model.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.kv_groups = attn.num_key_value_groups
        self.kv_heads = cfg.num_key_value_heads
        self.qk_norm = hasattr(attn, "q_norm")
        self.eps = cfg.rms_norm_eps
        self.act = ACT2FN[cfg.hidden_act]
        self.num_layers = len(model.model.layers)
        # Every name (tied aliases too) -> the model's tensor, and -> the canonical name a
        # full fine-tuning version keys its tensors by (see weights.parameter_aliases).
        self.base = dict(model.named_parameters(remove_duplicate=False))
        first: dict[int, str] = {}
        self.canonical = {n: first.setdefault(id(t), n) for n, t in self.base.items()}

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
    ) -> torch.Tensor:
        """Logits [B, T', V] (T' = T if logits_to_keep == 0 else logits_to_keep)."""
        w = _Weights(self.base, self.canonical, params or {}, lora or {})
        h = F.embedding(input_ids, w["model.embed_tokens.weight"])
        rope = _Rope(*self.model.model.rotary_emb(h, position_ids))
        # Decode on CPU in fp32: folded-GQA batched matmuls (faster than SDPA's CPU kernel
        # there). Elsewhere SDPA, whose GPU kernels keep the scores in fp32 for bf16 models.
        bmm_decode = input_ids.shape[1] == 1 and h.device.type == "cpu" and h.dtype == torch.float32
        bias = self._decode_bias(mask, h.dtype) if bmm_decode else None
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            x = self._norm(h, w[p + "input_layernorm.weight"])
            h = h + self._attention(x, p + "self_attn.", i, rope, mask, bias, cache, w)
            x = self._norm(h, w[p + "post_attention_layernorm.weight"])
            m = p + "mlp."
            gate = self.act(w.linear(x, m + "gate_proj"))
            h = h.add_(w.linear(gate.mul_(w.linear(x, m + "up_proj")), m + "down_proj"))  # h is this forward's own
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        return w.linear(self._norm(h, w["model.norm.weight"]), "lm_head")

    def _attention(self, x, prefix, layer, rope: "_Rope", mask, bias, cache, w) -> torch.Tensor:
        b, t, _ = x.shape
        shape = (b, t, -1, self.head_dim)
        q = w.linear(x, prefix + "q_proj").view(shape)
        k = w.linear(x, prefix + "k_proj").view(shape)
        v = w.linear(x, prefix + "v_proj").view(shape).transpose(1, 2)
        if self.qk_norm:
            q, k = self._norm(q, w[prefix + "q_norm.weight"]), self._norm(k, w[prefix + "k_norm.weight"])
        q, k = rope(q.transpose(1, 2)), rope(k.transpose(1, 2))
        k, v = cache.layers[layer].update(k, v, layer)
        o = self._decode_attention(q, k, v, bias) if bias is not None else self._sdpa(q, k, v, mask)
        return w.linear(o.transpose(1, 2).reshape(b, t, -1), prefix + "o_proj")

    def _decode_bias(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The decode mask [B, 1, 1, kv] as an additive bias [B * kv_heads, 1, kv] (once per forward)."""
        mask = additive_mask(mask, dtype)
        b, kv = mask.shape[0], mask.shape[-1]
        return mask.expand(b, self.kv_heads, 1, kv).reshape(b * self.kv_heads, 1, kv)

    def _decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor):
        """One query position: the g query heads sharing a KV head become g query rows of it,
        so no KV head is copied, and two batched matmuls beat SDPA's blocked CPU kernel at
        this shape."""
        b, heads, _, d = q.shape
        rows = b * self.kv_heads
        k3, v3 = k.reshape(rows, -1, d), v.reshape(rows, -1, d)
        scores = torch.bmm(q.reshape(rows, -1, d), k3.transpose(1, 2)).mul_(self.scaling).add_(bias)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(probs, v3).view(b, heads, 1, d)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling,
                                              enable_gqa=self.kv_groups > 1)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm exactly as Llama/Qwen compute it (fp32 statistics, weight after the cast back;
        the in-place steps only touch tensors made here)."""
        if x.dtype == torch.float32:
            return (x * x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()).mul_(weight)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x.to(dtype)


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

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        half = cos.shape[-1] // 2
        self.half = half
        self.cos = cos.unsqueeze(1)
        self.sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.cos + x.roll(self.half, dims=-1) * self.sin
