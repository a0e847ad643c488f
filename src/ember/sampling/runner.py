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
"""

from __future__ import annotations

import torch
from torch import nn

from ember.sampling.decoder import DirectDecoder, additive_mask, unsupported_reason
from ember.sampling.kv_cache import SlotCache
from ember.sampling.weights import LoraHooks, TorchWeightVersion, lora_plan


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
        self.additive_mask = attn_implementation == "eager"
        self.direct = _direct_decoder(model, forward)

    def _mask(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return additive_mask(mask, dtype) if self.additive_mask else mask

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
    ) -> torch.Tensor:
        """Logits [B, T', V] for a forward whose cache plan is already set. `vision`: a
        vision-language model's extra arguments (`PromptImages.forward_kwargs`; its
        `position_ids` are 4 x B x T: cache positions, then M-RoPE's three)."""
        dtype = next(self.model.parameters()).dtype
        if self.direct is not None and not vision:
            try:
                return self.direct.forward(input_ids, position_ids, self._mask(mask, dtype), self.cache,
                                           logits_to_keep, params=full.params if full is not None else None,
                                           lora=lora_plan(list(lora)))
            finally:
                self.cache.clear_plan()
        kwargs = dict(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=self._mask(mask, dtype),
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        kwargs.update(vision or {})
        try:
            self.hooks.set_plan(lora_plan(list(lora)))
            if full is not None:
                out = torch.func.functional_call(self.model, full.params, args=(), kwargs=kwargs, strict=False)
            else:
                out = self.model(**kwargs)
        finally:
            self.hooks.clear()
            self.cache.clear_plan()
        return out.logits


def _direct_decoder(model: nn.Module, forward: str) -> DirectDecoder | None:
    if forward == "transformers":
        return None
    reason = unsupported_reason(model)
    if reason is None:
        return DirectDecoder(model)
    if forward == "direct":
        raise ValueError(f"SamplerConfig.forward='direct' is not available for this model: {reason}")
    return None
