"""What a model family is: everything ember knows about one Hugging Face `config.model_type`.

A family file (`llama.py`, `olmo2.py`, ...) builds one `ModelFamily`; `ember.models.families`
collects them into `FAMILIES`. The fields are read by exactly one place each:

* `tp_plan` by tensor parallelism (`ember.engine.parallel`);
* `lora` by LoRA target selection (`ember.models.lora`);
* `decode` by the sampler's direct decode forward (`ember.sampling.decoder`);
* `window_when_set` by `uses_sliding_window` (the sampler and the decoder);
* `value_head_class` by the value-head export (`ember.engine.hf_export`);
* `tiny_config` by the tiny test models (`ember.models.testing`, `ember tiny-model`);
* `vision` (vision-language families only) by image inputs (`ember.models.vision`), model
  loading (`ember.models.loading`), LoRA target selection and the engine's tower freezing;
* `moe` (mixture-of-experts families only) by expert LoRA (`ember.models.experts`: the
  adapter's per-expert A/B, merging, the sampler's expert versions) and the routing
  metrics and auxiliary loss (`ember.engine.moe`);
* `attention` by model loading (`ember.models.loading`: a family without an SDPA kernel);
* `packs_by_position` by the engine's packed micro-batches (`ember.engine.torch_engine`);
* `tiny_chat` by the tiny test models' tokenizer (`ember.models.testing`).

This module imports nothing from ember: the layer functions get the direct decoder's
operations as an argument (`DecodeOps`), so models/ stays below sampling/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch


@dataclass(frozen=True)
class TensorParallelPlan:
    """Submodule paths of one decoder layer, relative to the layer."""

    colwise: tuple[str, ...]  # outputs split over ranks (q/k/v, gate/up)
    rowwise: tuple[str, ...]  # inputs split over ranks, outputs all-reduced (o, down)
    head_norms: tuple[str, ...] = ()  # per-head norms over the local heads (skipped where absent)


LLAMA_TP_PLAN = TensorParallelPlan(
    colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
    rowwise=("self_attn.o_proj", "mlp.down_proj"),
    head_norms=("self_attn.q_norm", "self_attn.k_norm"),  # Qwen3's; absent in Llama/Qwen2/Mistral
)


@dataclass(frozen=True)
class LoraTargets:
    """Module-name suffixes Tinker's `train_attn` / `train_mlp` / `train_unembed` select."""

    attn: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    mlp: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    unembed: tuple[str, ...] = ("lm_head",)
    # 3-D expert parameters (peft's `target_parameters`), also selected by `train_mlp`
    experts: tuple[str, ...] = ()


@dataclass(frozen=True)
class MoeLayout:
    """Where a mixture-of-experts layer keeps its experts and router (docs/architecture.md#mixture-of-experts).

    `experts`: the experts module's path in a decoder layer; `params`: its fused 3-D
    weights in registration order (peft wraps the first innermost, so an adapter's
    `experts.base_layer.lora_A` is `params[-2]`'s and `experts.lora_A` is `params[-1]`'s);
    `transposed`: the weights are (E, in, out), as gpt-oss stores them, else (E, out, in)
    (`F.linear` per expert, Qwen3-MoE); `router`: the router module's path, whose first
    output is the (tokens, E) router logits; `num_experts` / `top_k`: the config's
    attribute names; `per_expert`: the hub's per-expert tensor names, each
    (module, fused weight, part, parts): `experts.N.<module>.weight` is part `part` of
    `parts` equal slices of expert N's `<fused weight>` along its output rows (Qwen3-MoE:
    gate_proj and up_proj are the two halves of gate_up_proj); () when the hub publishes
    the fused layout only (gpt-oss). `router_softmax`: how the router turns its logits
    into the chosen experts' weights, which routing replay recomputes for recorded
    experts (`ember.engine.moe.replay_weights`): "all" (softmax over every expert, the
    chosen ones' probabilities, renormalised when the config's `norm_topk_prob` says so;
    Qwen3-MoE) or "top_k" (softmax over the chosen experts' logits; gpt-oss)."""

    router: str
    num_experts: str
    experts: str = "mlp.experts"
    params: tuple[str, ...] = ("gate_up_proj", "down_proj")
    transposed: bool = False
    top_k: str = "num_experts_per_tok"
    per_expert: tuple[tuple[str, str, int, int], ...] = ()
    router_softmax: str = "all"

    @property
    def param_paths(self) -> tuple[str, ...]:
        """The expert weights' paths in a decoder layer (LoRA's `target_parameters`)."""
        return tuple(f"{self.experts}.{p}" for p in self.params)


@dataclass(frozen=True)
class TinyChat:
    """The special tokens and chat template of a family's tiny byte-level tokenizer:
    `special` are single tokens (the first is the pad), `eos` ends an assistant turn,
    `template` is the Jinja chat template, `name` what it is called."""

    name: str
    special: tuple[str, ...]
    eos: str
    template: str


class DecodeOps(Protocol):
    """What the direct decoder offers a family's layer function (one forward, layer `i`)."""

    def norm(self, x: torch.Tensor, i: int, name: str) -> torch.Tensor: ...

    def attention(self, x: torch.Tensor, i: int) -> torch.Tensor: ...

    def mlp(self, x: torch.Tensor, i: int) -> torch.Tensor: ...


def pre_norm_layer(ops: DecodeOps, h: torch.Tensor, i: int) -> torch.Tensor:
    """Llama's layer: h + attn(norm(h)), then h + mlp(norm(h)) (h is the forward's own tensor)."""
    h = h + ops.attention(ops.norm(h, i, "input_layernorm"), i)
    return h.add_(ops.mlp(ops.norm(h, i, "post_attention_layernorm"), i))


def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama/Qwen compute it: fp32 statistics, the weight applied after the cast
    back (the in-place steps only touch tensors made here)."""
    if x.dtype == torch.float32:
        return (x * x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()).mul_(weight)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


QK_NORMS = ("none", "head", "projection")


@dataclass(frozen=True)
class DirectDecode:
    """The family's decoder layer as `ember.sampling.decoder.DirectDecoder` computes it.

    `layer(ops, h, i)` composes norms, attention and the gated MLP; `qk_norm` says where
    q/k are normalised: "none", "head" (each head, Qwen3) or "projection" (the whole q/k
    projection before the split into heads, OLMo 2); `rms_norm(x, weight, eps)` is the
    family's RMSNorm (the cast order matters in bf16)."""

    layer: Callable[[DecodeOps, torch.Tensor, int], torch.Tensor] = pre_norm_layer
    qk_norm: str = "none"
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = llama_rms_norm

    def __post_init__(self) -> None:
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"DirectDecode.qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")


VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def mrope_section(head_dim: int) -> list[int]:
    """M-RoPE's split of the rotary half-dimension over (time, height, width), in Qwen's
    proportions (24:20:20 of 64); the three parts sum to head_dim // 2."""
    half = head_dim // 2
    spatial = (half * 5) // 16
    return [half - 2 * spatial, spatial, spatial]


def vision_config_kwargs(kwargs: dict, token_ids: dict[str, int]) -> dict:
    """A vision-language config's top-level arguments from ember's tiny-model arguments:
    the text ones go in `text_config` (with M-RoPE), the placeholder ids and the
    embedding tie at the top."""
    text = dict(kwargs)
    tie = text.pop("tie_word_embeddings", False)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                               "mrope_section": mrope_section(int(text["head_dim"]))}
    return dict(text_config=text, tie_word_embeddings=tie, **token_ids)


@dataclass(frozen=True)
class VisionFamily:
    """What a vision-language family adds (docs/architecture.md#images).

    `model_class`: the transformers class the model loads through (from its own module,
    so no auto-class mapping decides it); `tower`: the vision tower's module name (LoRA
    never targets it; the engine freezes it unless `train_vision`); `language_model`: the
    decoder's module name; the placeholder tokens are the chat template's (`image_token`
    repeated once per merged patch, between `start_token` and `end_token`);
    `tiny_vision_config(out_hidden_size)` the tower of the tiny test model;
    `tiny_patch_size` its patch size (the tiny image processor's too)."""

    model_class: str
    tiny_vision_config: Callable[[int], dict]
    tiny_patch_size: int
    tower: str = "visual"
    language_model: str = "language_model"
    start_token: str = VISION_TOKENS[0]
    end_token: str = VISION_TOKENS[1]
    image_token: str = VISION_TOKENS[2]
    video_token: str = VISION_TOKENS[3]

    @property
    def special_tokens(self) -> tuple[str, ...]:
        return (self.start_token, self.end_token, self.image_token, self.video_token)

    @property
    def tower_pattern(self) -> str:
        """A regex (peft's `exclude_modules`) matching the tower and every module inside it."""
        return rf"(.*\.)?{self.tower}(\..*)?"


@dataclass(frozen=True)
class ModelFamily:
    """One decoder family (see the module docstring for who reads each field).

    `tp_plan` None: no tensor parallelism; `decode` None: the sampler uses the transformers
    forward; `value_head_class` None: transformers has no token classifier for the family,
    so a value-head run exports only as a training checkpoint or a peft adapter;
    `tiny_config(**kwargs)` builds the family's transformers config from ember's tiny-model
    arguments (`ember.models.testing.tiny_config`); `vision` None: a text-only model;
    `moe` None: a dense model; `config_types`: more model types that are this family
    (Qwen3.5's checkpoints say `qwen3_5`, the text model they load as says `qwen3_5_text`)."""

    model_type: str
    tiny_config: Callable[..., Any]
    tp_plan: TensorParallelPlan | None = LLAMA_TP_PLAN
    lora: LoraTargets = field(default_factory=LoraTargets)
    decode: DirectDecode | None = field(default_factory=DirectDecode)
    window_when_set: bool = False
    value_head_class: str | None = None
    vision: VisionFamily | None = None
    moe: MoeLayout | None = None
    attention: str | None = None  # the attention kernel when the family has no SDPA one (gpt-oss: "eager")
    # transformers' forward finds packed sequences from restarting position_ids; False: the
    # engine passes the block-diagonal mask itself (gpt-oss's model builds its masks without them)
    packs_by_position: bool = True
    tiny_chat: TinyChat | None = None  # None: ChatML (`ember.models.testing`)
    config_types: tuple[str, ...] = ()  # other `config.model_type`s of the family (a checkpoint's text config)
    head_qk_norm: bool = False  # RMSNorm per query/key head without direct decode (Qwen3-MoE; the estimate counts it)

    @property
    def direct_decode(self) -> bool:
        return self.decode is not None
