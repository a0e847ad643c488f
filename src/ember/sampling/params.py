"""Validate a `SamplingRequest` and resolve its defaults (pure functions, no model).

Every error is a `UserError` (a ValueError: `ember.errors`) naming the field, what was expected and what came, so a
bad request fails alone and the caller sees why (docs/architecture.md contract 7).
"""

from __future__ import annotations

import math
import secrets
import uuid
from dataclasses import dataclass

from tinker import types

from ember.errors import UserError
from ember.sampling.base import SamplingRequest
from ember.sampling.prompt_extras import PromptTargets, check_alt_tokens_k, check_targets

_U64 = 1 << 64


@dataclass(frozen=True)
class ResolvedRequest:
    """A validated request with every default filled in."""

    request: SamplingRequest
    prompt: tuple[int, ...]
    num_samples: int
    max_tokens: int  # already capped so that prompt + completion <= max_len
    temperature: float
    top_k: int  # -1 = off
    top_p: float
    seed: int  # in [0, 2**64)
    stop_token_ids: tuple[int, ...]
    stop_strings: tuple[str, ...]
    logprobs_mode: str
    include_prompt_logprobs: bool
    topk_prompt_logprobs: int
    topk_sample_logprobs: int
    prompt_logprobs_last_n: int | None
    sequence_ids: tuple[str, ...]
    targets: PromptTargets | None = None  # target_prompt_logprobs, checked
    prompt_alt_tokens_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def scores_prompt(self) -> bool:
        """Whether any logits before the prompt's last position are needed."""
        return (self.include_prompt_logprobs or self.topk_prompt_logprobs > 0 or self.targets is not None
                or self.prompt_alt_tokens_k > 0)

    @property
    def first_scored_row(self) -> int:
        """The first prompt position whose logits the response needs (len(prompt) - 1:
        only the last one's, for the first sampled token); a prefix cache may serve the
        positions before it."""
        p = len(self.prompt)
        if self.targets is not None or self.prompt_alt_tokens_k > 0:
            return 0
        if self.include_prompt_logprobs or self.topk_prompt_logprobs > 0:
            n = self.prompt_logprobs_last_n
            return 0 if n is None else p - 1 - n
        return p - 1


def eos_token_ids(model_config, generation_config=None, tokenizer=None) -> tuple[int, ...]:
    """EOS ids: the tokenizer's, else the generation config's, else the model config's."""
    candidates = [
        getattr(tokenizer, "eos_token_id", None),
        getattr(generation_config, "eos_token_id", None),
        getattr(model_config, "eos_token_id", None),
    ]
    for c in candidates:
        if c is not None:
            return tuple(c) if isinstance(c, (list, tuple)) else (int(c),)
    return ()


def effective_max_len(wanted: int | None, model_config) -> int:
    """SamplerConfig.max_len, at most the model's max_position_embeddings (which it defaults to)."""
    positions = int(getattr(model_config, "max_position_embeddings", 0) or 0) or None
    chosen = wanted or positions or 2048
    return min(chosen, positions) if positions else chosen


def _fail(field: str, expected: str, got) -> UserError:
    return UserError(f"sample request: {field}: expected {expected}, got {got!r}")


def prompt_tokens(prompt: types.ModelInput, vocab_size: int) -> tuple[int, ...]:
    """The prompt's token ids, checked against the vocabulary."""
    if not isinstance(prompt, types.ModelInput):
        raise _fail("prompt", "a tinker.types.ModelInput", type(prompt).__name__)
    tokens: list[int] = []
    for c, chunk in enumerate(prompt.chunks):
        if not isinstance(chunk, types.EncodedTextChunk):
            raise _fail(f"prompt.chunks[{c}]", "an EncodedTextChunk (this sampler takes text tokens only)",
                        getattr(chunk, "type", type(chunk).__name__))
        tokens.extend(int(t) for t in chunk.tokens)
    if not tokens:
        raise _fail("prompt", "at least one token", "an empty prompt")
    bad = [i for i, t in enumerate(tokens) if not 0 <= t < vocab_size]
    if bad:
        i = bad[0]
        raise _fail(f"prompt token {i}", f"a token id in [0, {vocab_size})", tokens[i])
    return tuple(tokens)


def resolve_stop(stop, eos_token_ids: tuple[int, ...], vocab_size: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(stop token ids, stop strings): None → EOS; [] → nothing; otherwise the given ones + EOS."""
    if stop is None:
        return tuple(eos_token_ids), ()
    items = [stop] if isinstance(stop, str) else list(stop)
    if not items:
        return (), ()
    if all(isinstance(s, str) for s in items):
        for i, s in enumerate(items):
            if s == "":
                raise _fail(f"sampling_params.stop[{i}]", "a non-empty string", s)
            if not _is_utf8(s):  # a lone surrogate: no decoded text can hold it (and vLLM fails on it)
                raise _fail(f"sampling_params.stop[{i}]", "valid Unicode text (no lone surrogates)", s)
        return tuple(eos_token_ids), tuple(items)
    if all(isinstance(s, int) and not isinstance(s, bool) for s in items):
        for i, t in enumerate(items):
            if not 0 <= t < vocab_size:
                raise _fail(f"sampling_params.stop[{i}]", f"a token id in [0, {vocab_size})", t)
        return tuple(dict.fromkeys([*items, *eos_token_ids])), ()
    raise _fail("sampling_params.stop", "None, a string, a list of strings or a list of token ids", stop)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_int(field: str, value, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise _fail(field, f"an integer >= {low}", value)
    return value


def _check_params(p: types.SamplingParams, default_max_tokens: int) -> tuple[int, float, int, float]:
    max_tokens = default_max_tokens
    if p.max_tokens is not None:
        max_tokens = _check_int("sampling_params.max_tokens", p.max_tokens, 0)
    temperature = float(p.temperature)
    if not math.isfinite(temperature) or temperature < 0:
        raise _fail("sampling_params.temperature", "a finite number >= 0", p.temperature)
    top_k = p.top_k
    if not isinstance(top_k, int) or (top_k != -1 and top_k < 1):
        raise _fail("sampling_params.top_k", "-1 (off) or an integer >= 1", top_k)
    top_p = float(p.top_p)
    if not (0.0 < top_p <= 1.0):
        raise _fail("sampling_params.top_p", "a number in (0, 1]", p.top_p)
    return max_tokens, temperature, top_k, top_p


def _check_extras(r: SamplingRequest, prompt_len: int) -> None:
    _check_int("num_samples", r.num_samples, 1)
    _check_int("topk_prompt_logprobs", r.topk_prompt_logprobs, 0)
    _check_int("topk_sample_logprobs", r.topk_sample_logprobs, 0)
    if r.prompt_logprobs_last_n is not None:
        n = r.prompt_logprobs_last_n
        if not (r.include_prompt_logprobs or r.topk_prompt_logprobs):
            raise _fail("prompt_logprobs_last_n", "to be set only with prompt logprobs requested", n)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise _fail("prompt_logprobs_last_n", "an integer >= 1", n)
    if r.sequence_ids is not None and len(r.sequence_ids) != r.num_samples:
        raise _fail("sequence_ids", f"{r.num_samples} ids (one per sample)", len(r.sequence_ids))


def scored_last_n(n: int | None, prompt_len: int) -> int | None:
    """`prompt_logprobs_last_n` clamped to the positions a prompt has to score
    (len(prompt) - 1: the first token has no logprob); None = all of them."""
    return None if n is None or n >= prompt_len - 1 else n


def resolve_request(
    r: SamplingRequest,
    *,
    vocab_size: int,
    eos_token_ids: tuple[int, ...],
    max_len: int,
    default_max_tokens: int,
    default_logprobs_mode: str,
    can_decode: bool,
) -> ResolvedRequest:
    """Check `r` and fill in defaults; raise ValueError naming the offending field."""
    if not isinstance(r.owner, str):
        raise _fail("owner", "a string", type(r.owner).__name__)
    prompt = prompt_tokens(r.prompt, vocab_size)
    if len(prompt) >= max_len:
        raise _fail("prompt", f"fewer than {max_len} tokens (the sampler's max_len)", f"{len(prompt)} tokens")
    _check_extras(r, len(prompt))
    max_tokens, temperature, top_k, top_p = _check_params(r.sampling_params, default_max_tokens)
    if top_k >= vocab_size:  # keeps every token: the same as off, and no vocabulary-sized (or larger) allocation
        top_k = -1
    stop_ids, stop_strings = resolve_stop(r.sampling_params.stop, eos_token_ids, vocab_size)
    if stop_strings and not can_decode:
        raise _fail("sampling_params.stop", "token ids (this sampler has no tokenizer to match strings)", stop_strings)
    mode = r.logprobs_mode or default_logprobs_mode
    if mode not in ("raw", "processed"):
        raise _fail("logprobs_mode", "'raw' or 'processed'", mode)
    seed = secrets.randbits(64) if r.sampling_params.seed is None else int(r.sampling_params.seed) % _U64
    if r.sequence_ids is not None:
        ids = tuple(str(s) for s in r.sequence_ids)
    else:
        base = uuid.uuid4().hex[:16]
        ids = tuple(f"{base}-{i}" for i in range(r.num_samples))
    return ResolvedRequest(
        request=r, prompt=prompt, num_samples=r.num_samples,
        max_tokens=min(max_tokens, max_len - len(prompt)), temperature=temperature, top_k=top_k, top_p=top_p,
        seed=seed, stop_token_ids=stop_ids, stop_strings=stop_strings, logprobs_mode=mode,
        # more alternatives than the vocabulary has are not meaningful: clamp before allocating
        include_prompt_logprobs=bool(r.include_prompt_logprobs),
        topk_prompt_logprobs=min(r.topk_prompt_logprobs, vocab_size),
        topk_sample_logprobs=min(r.topk_sample_logprobs, vocab_size),
        prompt_logprobs_last_n=scored_last_n(r.prompt_logprobs_last_n, len(prompt)),
        sequence_ids=ids,
        targets=check_targets(r.target_prompt_logprobs, len(prompt), vocab_size),
        prompt_alt_tokens_k=check_alt_tokens_k(r.prompt_alt_tokens_k),
    )
