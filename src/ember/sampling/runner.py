"""Run the Hugging Face model for one prefill or decode forward over slot-cache rows.

Two ways to compute the same forward (`SamplerConfig.forward`):

* "transformers": the model is called exactly as transformers documents it:
  `input_ids`, explicit `position_ids`, a prepared 4-D attention mask (passed through by
  `create_causal_mask`), `past_key_values=SlotCache`, `logits_to_keep`. Weight versions
  enter only from the outside: `torch.func.functional_call` for full fine-tuning sets,
  forward hooks for LoRA.
* "direct" (`ember.sampling.decoder`): the same function with plain tensor ops for
  the model families that declare a decode layer (`ember.models.families`), which removes the per-call overhead that dominates small decode
  batches. "auto" (the default) uses it when the architecture is supported.

A prefill that scores its prompt can return the decoder's last hidden states instead of
its logits (`hidden=True`); `unembed` then applies the LM head, with the same weights, to
any rows of them (`ember.sampling.prompt_logits`: no (P, V) tensor for a long prompt).

With `use_static_decode` (`SamplerConfig.cuda_graphs`), a decode step on the base weights
or one LoRA version runs the direct forward over static shapes (`ember.sampling.cuda_graphs`:
captured and replayed on CUDA); other forwards run as above, counted as fallbacks.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ember.models.families import family_of
from ember.sampling.cuda_graphs import StaticDecode
from ember.sampling.decoder import DirectDecoder, additive_mask, unsupported_reason
from ember.sampling.kv_cache import SlotCache
from ember.sampling.experts import ExpertHooks, RouteRecorder, expert_plan
from ember.sampling.weights import LoraHooks, TorchWeightVersion, add_lora, lora_plan


def prefill_inputs(prompts: list[tuple[int, ...]], device: torch.device):
    """Left-pad prompts to a common length T.

    Returns input_ids, position_ids and valid ([B, T]) and a boolean mask [B, 1, T, T]:
    a real query attends causally to its own real tokens; a pad query attends only to
    itself (so no row is fully masked and no NaN can leak through a zero weight).
    """
    lengths = torch.tensor([len(p) for p in prompts])
    t = int(lengths.max())
    cols = torch.arange(t)
    start = (t - lengths)[:, None]  # first real column of each row
    valid = cols[None, :] >= start
    ids = torch.zeros((len(prompts), t), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, t - len(p):] = torch.tensor(p, dtype=torch.long)
    position_ids = (cols[None, :] - start).clamp_(min=0)
    causal = cols[None, :, None] >= cols[None, None, :]  # [1, Tq, Tk]
    mask = (causal & valid[:, None, :]) | torch.eye(t, dtype=torch.bool)[None]
    return ids.to(device), position_ids.to(device), valid.to(device), mask[:, None].to(device)


def extend_inputs(prompt: tuple[int, ...], start: int, device: torch.device):
    """input_ids, position_ids [1, T] and mask [1, 1, T, start + T] for prompt[start:] after a
    cached prefix of `start` tokens: query t attends keys 0..start + t."""
    t = len(prompt) - start
    ids = torch.tensor([prompt[start:]], dtype=torch.long, device=device)
    pos = torch.arange(start, start + t, device=device)[None]
    keys = torch.arange(start + t, device=device)
    mask = (keys[None, :] <= pos[0][:, None])[None, None]
    return ids, pos, mask


def decode_mask(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[B, 1, 1, kv_len]: row r attends cache positions 0..positions[r]."""
    keys = torch.arange(kv_len, device=positions.device)
    return (keys[None, :] <= positions[:, None])[:, None, None, :]


class ModelRunner:
    """Owns the model, its slot cache and LoRA hooks; one forward at a time (one thread)."""

    def __init__(self, model: nn.Module, cache: SlotCache, attn_implementation: str, forward: str = "auto") -> None:
        self.model = model
        self.cache = cache
        self.hooks = LoraHooks(model)
        self.expert_hooks = ExpertHooks(model)  # a mixture-of-experts version's expert LoRA
        self.route_recorder = RouteRecorder(model)  # a mixture-of-experts model's routes, for replay
        self.routes: torch.Tensor | None = None  # the last forward's (rows, T, layers, k) routes (MoE only)
        self.additive_mask = attn_implementation == "eager"
        self.direct = _direct_decoder(model, forward)
        self.lm_head = lm_head_of(model)  # None: prompt scoring keeps the forward's logits
        self.static: StaticDecode | None = None  # `use_static_decode`

    def use_static_decode(self, max_rows: int, device: torch.device) -> StaticDecode:
        """Run decode steps (base weights or one LoRA version) of up to `max_rows` rows through the direct forward
        over static shapes (`ember.sampling.cuda_graphs`; captured on CUDA, eager elsewhere)."""
        if self.direct is None:
            raise ValueError("the static decode path runs the direct forward, which this runner does not have")
        self.static = StaticDecode(self.cache, self._static_step, max_rows, device)
        return self.static

    def _static_step(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     kv_len: int, lora: dict | None) -> torch.Tensor:
        """One decode forward over rows that read `kv_len` KV positions (the mask, built
        here from `positions`, hides each row's stale tail), with a LoRA plan or none."""
        dtype = next(self.model.parameters()).dtype
        self.cache.plan_decode(slots, positions, kv_len)
        try:
            mask = self._mask(decode_mask(positions, kv_len), dtype)
            return self.direct.forward(ids, positions[:, None], mask, self.cache, 1, lora=lora)
        finally:
            self.cache.clear_plan()

    def _static_fallback(self, input_ids: torch.Tensor, logits_to_keep: int, full, lora, vision,
                         hidden: bool) -> str | None:
        """Why this forward does not take the static decode path (None: it does)."""
        plan = self.cache.plan
        if plan is None or plan.prefill or input_ids.shape[1] != 1:
            return "prefill"
        reasons = (("extend", plan.extend), ("vision", bool(vision)), ("full_version", full is not None),
                   ("lora_mixed", len(lora) > 1 or (len(lora) == 1 and lora[0][0] is not None)),
                   ("lora_experts", any(v.experts for _, v in lora)), ("hidden", hidden or logits_to_keep != 1),
                   ("shape", self.static.shape(int(input_ids.shape[0]), plan.kv_len) is None))
        return next((name for name, hit in reasons if hit), None)

    def _try_static(self, input_ids: torch.Tensor, logits_to_keep: int, full, lora, vision,
                    hidden: bool) -> torch.Tensor | None:
        """The static path's logits, or None (counted by reason) when the forward cannot take it."""
        reason = self._static_fallback(input_ids, logits_to_keep, full, lora, vision, hidden)
        if reason is not None:
            self.static.stats.fallback(reason)
            return None
        plan = self.cache.plan
        slots = plan.slots
        if isinstance(slots, slice):
            slots = torch.arange(slots.start or 0, slots.stop, device=input_ids.device)
        positions, kv_len = plan.positions, plan.kv_len
        self.cache.clear_plan()
        return self.static.run(input_ids, positions, slots, kv_len, lora[0][1] if lora else None)

    def _mask(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return additive_mask(mask, dtype) if self.additive_mask else mask

    def _attention_mask(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | dict:
        """The transformers forward's `attention_mask`. With linear-attention layers, the
        documented per-layer-type mapping: the prepared mask for attention, and for the
        linear layers a prefill's [B, T] padding mask (which zeroes the left pads' inputs,
        so no state builds up before a prompt's first token; None when nothing is padded)."""
        prepared = self._mask(mask, dtype)
        if not self.cache.recurrent:
            return prepared
        plan = self.cache.plan
        pads = plan is not None and plan.prefill and not bool(plan.valid.all())
        return {"full_attention": prepared, "linear_attention": plan.valid.to(dtype) if pads else None}

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        logits_to_keep: int,
        full: TorchWeightVersion | None = None,
        lora: list[tuple[torch.Tensor | None, TorchWeightVersion]] = (),
        vision: dict | None = None,
        hidden: bool = False,
    ) -> torch.Tensor:
        """Logits [B, T', V] for a forward whose cache plan is already set. `vision`: a
        vision-language model's extra arguments (`PromptImages.forward_kwargs`; its
        `position_ids` are 4 x B x T: cache positions, then M-RoPE's three). `hidden`
        (needs `lm_head`; with logits_to_keep 0): the last hidden states [B, T, H] instead,
        for `unembed`."""
        if hidden and (self.lm_head is None or logits_to_keep):
            raise ValueError("ModelRunner.forward(hidden=True) needs a plain LM head and logits_to_keep=0")
        dtype = next(self.model.parameters()).dtype
        if self.static is not None:
            static = self._try_static(input_ids, logits_to_keep, full, lora, vision, hidden)
            if static is not None:
                return static
        if self.direct is not None and not vision:
            try:
                return self.direct.forward(input_ids, position_ids, self._mask(mask, dtype), self.cache,
                                           logits_to_keep, params=full.params if full is not None else None,
                                           lora=lora_plan(list(lora)), hidden=hidden)
            finally:
                self.cache.clear_plan()
        kwargs = dict(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=self._attention_mask(mask, dtype),
            past_key_values=self.cache,
            use_cache=True,
            # hidden: an empty index list, so transformers runs its LM head on no position
            logits_to_keep=torch.empty(0, dtype=torch.long, device=input_ids.device) if hidden else logits_to_keep,
        )
        kwargs.update(vision or {})
        captured: list[torch.Tensor] = []
        routes: list[torch.Tensor] = []
        self.routes = None
        try:
            self.hooks.set_plan(lora_plan(list(lora)), int(input_ids.shape[0]))
            self.expert_hooks.set_plan(expert_plan(list(lora)), int(input_ids.shape[0]))
            with self._capture_last_hidden(captured, hidden), \
                    self.route_recorder.capture(int(input_ids.shape[0]), routes):
                if full is not None:
                    out = torch.func.functional_call(self.model, full.params, args=(), kwargs=kwargs, strict=False)
                else:
                    out = self.model(**kwargs)
        finally:
            self.hooks.clear()
            self.expert_hooks.clear()
            self.cache.clear_plan()
        self.routes = routes[0] if routes else None
        return captured[0] if hidden else out.logits

    @contextlib.contextmanager
    def _capture_last_hidden(self, captured: list, wanted: bool):
        """The decoder's output (its last hidden state, after the final norm) into
        `captured`, by a forward hook for this call only (as the engine's chunked head)."""
        if not wanted:
            yield
            return
        handle = self.model.get_decoder().register_forward_hook(lambda _m, _a, output: captured.append(output[0]))
        try:
            yield
        finally:
            handle.remove()

    @torch.inference_mode()
    def unembed(self, hidden: torch.Tensor, full: TorchWeightVersion | None = None,
                lora: list[tuple[torch.Tensor | None, TorchWeightVersion]] = ()) -> torch.Tensor:
        """Logits [N, V] of last hidden states [N, H] from `forward(..., hidden=True)`, with
        the weights that forward ran with (`lora`'s rows index `hidden`'s; None = all)."""
        return self.lm_head(hidden, full, lora)


class LMHead:
    """The model's output embedding as a function of a forward's weights: logits =
    F.linear(hidden, weight, bias) plus the LoRA delta a version has on it, the same
    expression as the module (hooked for LoRA) or `DirectDecoder`'s `linear`."""

    def __init__(self, model: nn.Module, module: nn.Linear) -> None:
        self.module = module
        self.name = next(name for name, m in model.named_modules() if m is module)
        first: dict[int, str] = {}  # a full version keys its tensors by canonical names (weights.parameter_aliases)
        canonical = {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}
        self.weight_key = canonical[f"{self.name}.weight"]
        self.bias_key = canonical.get(f"{self.name}.bias")
        self.vocab_size = int(module.out_features)

    def __call__(self, hidden: torch.Tensor, full: TorchWeightVersion | None,
                 lora: list[tuple[torch.Tensor | None, TorchWeightVersion]]) -> torch.Tensor:
        params = full.params if full is not None else None
        weight = params[self.weight_key] if params else self.module.weight
        bias = None if self.bias_key is None else (params[self.bias_key] if params else self.module.bias)
        out = F.linear(hidden, weight, bias)
        entries = lora_plan(list(lora)).get(self.name)
        return add_lora(out, hidden, entries) if entries else out


def lm_head_of(model: nn.Module) -> LMHead | None:
    """The LM head when the model's logits are exactly a Linear of its last hidden state:
    the families of `ember.models.families` (no logit scaling or soft-capping); None for
    other architectures, whose prompt scoring keeps the forward's own logits."""
    module = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if family_of(model.config) is None or not isinstance(module, nn.Linear):
        return None
    return LMHead(model, module)


def _direct_decoder(model: nn.Module, forward: str) -> DirectDecoder | None:
    if forward == "transformers":
        return None
    reason = unsupported_reason(model)
    if reason is None:
        return DirectDecoder(model)
    if forward == "direct":
        raise ValueError(f"SamplerConfig.forward='direct' is not available for this model: {reason}")
    return None
