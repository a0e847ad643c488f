"""`SamplerConfig`: everything a TorchSampler needs to know besides its model."""

from __future__ import annotations

from dataclasses import dataclass

from ember.models.loading import resolve_dtype

DEFAULT_MAX_TOKENS = 128
LOGPROBS_MODES = ("raw", "processed")
FORWARDS = ("auto", "direct", "transformers")


@dataclass
class SamplerConfig:
    """Configuration of one sampler (one base model; any number of weight versions).

    max_slots: sequences decoded together (KV-cache slots). A request with `num_samples`
        samples takes that many slots; when they are all busy, further samples wait and
        take the next slot that frees up (continuous batching).
    max_len: the most tokens (prompt + completion) one sequence may hold. A longer prompt
        is refused; a completion that reaches it ends with stop_reason "length". The KV
        cache grows on demand up to `max_slots x max_len` positions per layer.
    default_max_tokens: `SamplingParams.max_tokens` when the request leaves it unset
        (the SDK allows that; Tinker's own default is not documented). 128.
    max_prefill_tokens: padded tokens (rows x longest prompt) in one prefill forward;
        more prompts are prefilled in several forwards.
    logprobs_mode: default for requests that do not choose: "raw" returns logprobs of the
        model's distribution (softmax of the logits, before temperature/top-k/top-p),
        Tinker's semantics; "processed" returns logprobs of the distribution actually
        sampled from (exact importance weights for off-policy corrections).
    dtype / device / attn_implementation: as for `ember.models.load_model`.
    forward: how a forward is computed. "transformers" calls the model's own forward;
        "direct" computes the same function with plain tensor ops (Llama, Mistral, Qwen2,
        Qwen3 families; several times less per-call overhead, which dominates decoding
        small batches); "auto" (default) is "direct" where supported, else "transformers".
    """

    max_slots: int = 64
    max_len: int = 2048
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_prefill_tokens: int = 8192
    logprobs_mode: str = "raw"
    dtype: str = "float32"
    device: str = "cpu"
    attn_implementation: str = "sdpa"
    forward: str = "auto"

    def __post_init__(self) -> None:
        positive = ("max_slots", "max_len", "default_max_tokens", "max_prefill_tokens")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SamplerConfig.{name} must be an integer >= 1, got {value!r}")
        if self.max_len < 2:
            raise ValueError(
                f"SamplerConfig.max_len must be >= 2 (a prompt token and a sampled one), got {self.max_len}"
            )
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"SamplerConfig.logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.forward not in FORWARDS:
            raise ValueError(f"SamplerConfig.forward must be one of {FORWARDS}, got {self.forward!r}")
        resolve_dtype(self.dtype)
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"SamplerConfig.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.attn_implementation not in ("sdpa", "eager"):
            # The sampler hands transformers an explicit 4-D boolean mask; sdpa and eager
            # consume it as is. flash/flex attention take other mask formats.
            raise ValueError(
                f"SamplerConfig.attn_implementation must be 'sdpa' or 'eager', got {self.attn_implementation!r}"
            )
