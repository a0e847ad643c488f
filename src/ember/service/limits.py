"""`Limits`: every count and size a request carries, bounded before anything is allocated.

An untrusted request names counts (samples, tokens, datums, top-k sizes, how far ahead a
`seq_id` is) that decide how much memory and time the service will spend on it. Each is
checked here, before a future's sequence ids are made, a sampler slot is reserved or a
lane waits, and refused as a user error naming the field, the value and the limit
(`ember serve --limits.KEY VALUE`, the `[limits]` table of `--config`).

The request body itself is bounded earlier, by the server (`--max-body-mb`), so a
request's lists are already finite when they get here; these limits keep what the
service *derives* from them (KV cache rows, logprob tensors, waits) bounded too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from ember.service.api import UserError


DEFAULT_DATUM_TOKENS = 131072  # the datum limit for a model whose config names no positions


@dataclass
class Limits:
    """Per-request limits of the service (each refused as a user error naming the field).

    max_num_samples: `num_samples` of one sample request.
    max_sample_tokens: `sampling_params.max_tokens` (new tokens per sample).
    max_prompt_tokens: tokens of one sampling prompt.
    max_topk_logprobs: `topk_prompt_logprobs`, `topk_sample_logprobs` and `prompt_alt_tokens_k`.
    max_datums_per_request: datums of one forward / forward_backward request.
    max_datum_tokens: `model_input` tokens of one datum; None (the default): the model's
        positions (`max_position_embeddings` in its config.json; `DEFAULT_DATUM_TOKENS` for a
        model that names none). A number caps every model at it, never above its positions.
    max_request_tokens: `model_input` tokens of all datums of one request together.
    max_seq_ahead: how far a training request's `seq_id` may be ahead of the next one the
        run expects (further would wait, then skip every request in between).
    max_lora_rank: `lora_config.rank` of a new training run (its adapters' memory grows
        with it).
    """

    max_num_samples: int = 256
    max_sample_tokens: int = 32768
    max_prompt_tokens: int = 131072
    max_topk_logprobs: int = 100
    max_datums_per_request: int = 4096
    max_datum_tokens: int | None = None
    max_request_tokens: int = 1048576
    max_seq_ahead: int = 1024
    max_lora_rank: int = 512

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "max_datum_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"limits.{f.name} must be an integer >= 1, got {value!r}")

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # ------------------------------------------------------------------ sampling
    def check_sample(self, num_samples: Any, prompt: Any, sampling_params: Any, topk_prompt: Any,
                     topk_sample: Any, alt_tokens_k: Any = 0) -> None:
        """A sample request's counts; called before its future reserves sequence ids."""
        _bounded("num_samples", num_samples, self.max_num_samples, minimum=1)
        max_tokens = getattr(sampling_params, "max_tokens", None)
        if max_tokens is not None:
            _bounded("sampling_params.max_tokens", max_tokens, self.max_sample_tokens, minimum=0)
        n_prompt = _prompt_length(prompt)
        if n_prompt is not None and n_prompt > self.max_prompt_tokens:
            raise UserError(f"prompt has {n_prompt} tokens; the limit is max_prompt_tokens={self.max_prompt_tokens}")
        _bounded("topk_prompt_logprobs", topk_prompt or 0, self.max_topk_logprobs, minimum=0)
        _bounded("topk_sample_logprobs", topk_sample or 0, self.max_topk_logprobs, minimum=0)
        _bounded("prompt_alt_tokens_k", alt_tokens_k or 0, self.max_topk_logprobs, minimum=0)

    # ------------------------------------------------------------------ training
    def datum_tokens(self, positions: int | None) -> tuple[int, str]:
        """(the longest datum a model with `positions` accepts, the setting that says so)."""
        if self.max_datum_tokens is None:
            if positions:
                return positions, f"the model's max_position_embeddings={positions}"
            return DEFAULT_DATUM_TOKENS, f"max_datum_tokens={DEFAULT_DATUM_TOKENS}"
        if positions and positions < self.max_datum_tokens:
            return positions, f"the model's max_position_embeddings={positions}"
        return self.max_datum_tokens, f"max_datum_tokens={self.max_datum_tokens}"

    def check_datums(self, data: Sequence[Any], positions: int | None = None) -> None:
        """A forward(_backward) request's datum count and token lengths; before it is queued.
        `positions`: the run's model's `max_position_embeddings` (None: unknown)."""
        if len(data) > self.max_datums_per_request:
            raise UserError(f"data has {len(data)} datums; the limit is "
                            f"max_datums_per_request={self.max_datums_per_request}")
        longest, why = self.datum_tokens(positions)
        total = 0
        for i, datum in enumerate(data):
            n = _prompt_length(getattr(datum, "model_input", None))
            if n is None:
                continue  # malformed datums are the engine's validation's to name
            if n > longest:
                raise UserError(f"data[{i}].model_input has {n} tokens; the limit is {why}")
            total += n
        if total > self.max_request_tokens:
            raise UserError(f"data has {total} model_input tokens in all; the limit is "
                            f"max_request_tokens={self.max_request_tokens}")

    def check_lora_rank(self, lora_config: Any) -> None:
        rank = getattr(lora_config, "rank", None)
        if isinstance(rank, int) and not isinstance(rank, bool) and rank > self.max_lora_rank:
            raise UserError(f"lora_config.rank={rank} is over the limit max {self.max_lora_rank} "
                            "(limits.max_lora_rank)")

    def check_seq_ahead(self, seq_id: int, next_seq: int, model_id: str) -> None:
        if seq_id - next_seq > self.max_seq_ahead:
            raise UserError(f"seq_id {seq_id} of {model_id} is {seq_id - next_seq} ahead of the next expected "
                            f"({next_seq}); the limit is max_seq_ahead={self.max_seq_ahead}")


def _bounded(field: str, value: Any, limit: int, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{field} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise UserError(f"{field} must be >= {minimum}, got {value}")
    if value > limit:
        raise UserError(f"{field}={value} is over the limit max {limit} (limits.{_LIMIT_OF[field]})")


_LIMIT_OF = {
    "num_samples": "max_num_samples",
    "sampling_params.max_tokens": "max_sample_tokens",
    "topk_prompt_logprobs": "max_topk_logprobs",
    "topk_sample_logprobs": "max_topk_logprobs",
    "prompt_alt_tokens_k": "max_topk_logprobs",
}


def _prompt_length(model_input: Any) -> int | None:
    """Tokens of a `ModelInput` without materialising them (None when it is not one)."""
    length = getattr(model_input, "length", None)
    if length is None:
        return None
    try:
        return int(length() if callable(length) else length)
    except Exception:  # noqa: BLE001 - a malformed chunk is the validator's to report
        return None
