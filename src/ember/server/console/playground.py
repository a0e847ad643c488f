"""The playground: sample a base model or a sampler checkpoint from a form.

Sampling is the OpenAI routes' (`ember.server.routes_openai`): one internal client
session per key and a cached sampling session per (key, model), through
`ServiceAPI.sample`, so limits, owner checks and numerics are the sampler's: with a seed,
the tokens equal what the SDK's `SamplingClient.sample` returns for the same prompt.
The prompt is raw text (tokenized without special tokens) or one user message through
the tokenizer's chat template. Each sampled token is shown with its logprob.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from tinker import types

from ember.server import routes_openai
from ember.server.console.pages import PageError, PageNotFound, call
from ember.server.errors import BadRequest

MAX_PROMPT_CHARS = 32 * 1024
LISTED_CHECKPOINTS = 200


@dataclass
class PlaygroundForm:
    mode: str = "base"  # base | checkpoint
    base_model: str = ""
    checkpoint: str = ""
    prompt: str = ""
    prompt_format: str = "raw"  # raw | chat
    temperature: float = 1.0
    max_tokens: int = 16
    num_samples: int = 1
    seed: int | None = None

    @property
    def model(self) -> str:
        return self.checkpoint if self.mode == "checkpoint" else self.base_model


async def choices(service, owner: str) -> dict[str, list[str]]:
    """Base models, and the key's own sampler checkpoints (newest first)."""
    caps = await call(service.get_server_capabilities)
    listed = await call(service.list_user_checkpoints, owner, LISTED_CHECKPOINTS, 0)
    return {"base_models": [m.model_name for m in caps.supported_models if m.model_name],
            "checkpoints": [c.tinker_path for c in listed.checkpoints if c.checkpoint_type == "sampler"]}


def defaults(mode: str, checkpoint: str, base_model: str, found: dict[str, list[str]]) -> PlaygroundForm:
    if mode == "checkpoint" or (checkpoint and mode != "base"):
        return PlaygroundForm(mode="checkpoint", checkpoint=checkpoint[:1024])
    return PlaygroundForm(mode="base", base_model=base_model[:512] or next(iter(found["base_models"]), ""))


def _number(form: dict[str, str], name: str, kind: type, lo: float, hi: float, default: Any) -> Any:
    text = form.get(name, "").strip()
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        raise PageError(f"{name}: expected {'an integer' if kind is int else 'a number'}, got {text[:40]!r}") from None
    if not (isinstance(value, int) or math.isfinite(value)) or not lo <= value <= hi:
        raise PageError(f"{name}: expected a value in [{lo:g}, {hi:g}], got {text[:40]!r}")
    return value


def parse(form: dict[str, str]) -> PlaygroundForm:
    """The posted form, checked field by field (each error names its field)."""
    mode = form.get("mode", "base")
    if mode not in ("base", "checkpoint"):
        raise PageError(f"mode: expected 'base' or 'checkpoint', got {mode[:40]!r}")
    fmt = form.get("prompt_format", "raw")
    if fmt not in ("raw", "chat"):
        raise PageError(f"prompt_format: expected 'raw' or 'chat', got {fmt[:40]!r}")
    prompt = form.get("prompt", "")
    if not prompt or len(prompt) > MAX_PROMPT_CHARS:
        raise PageError(f"prompt: expected 1 to {MAX_PROMPT_CHARS} characters, got {len(prompt)}")
    return PlaygroundForm(
        mode=mode, base_model=form.get("base_model", "")[:512], checkpoint=form.get("checkpoint", "")[:1024],
        prompt=prompt, prompt_format=fmt,
        temperature=_number(form, "temperature", float, 0.0, 100.0, 1.0),
        max_tokens=_number(form, "max_tokens", int, 1, 1 << 20, 16),
        num_samples=_number(form, "num_samples", int, 1, 1 << 16, 1),
        seed=_number(form, "seed", int, 0, 2 ** 63 - 1, None),
    )


async def run(request: Request, owner: str, service, form: PlaygroundForm) -> list[dict[str, Any]]:
    """Sample; each sequence as its tokens (id, text, logprob) and text."""
    if not form.model:
        raise PageError("pick a base model or a sampler checkpoint")
    cache = routes_openai.sampler_cache(request, service)
    try:
        _, tokenizer = await run_in_threadpool(cache.get, owner, form.model)
        prompt = await run_in_threadpool(_prompt, form, tokenizer)
        params = types.SamplingParams(max_tokens=form.max_tokens, temperature=form.temperature, seed=form.seed)
        seqs, tokenizer = await routes_openai.sample_prompt(request, owner, service, form.model, prompt, form.num_samples,
                                                      params, 0)
    except routes_openai.ModelNotFound as exc:
        raise PageNotFound(str(exc)) from None
    except BadRequest as exc:
        raise PageError(str(exc)) from None
    return await run_in_threadpool(_decode, tokenizer, seqs)


def _prompt(form: PlaygroundForm, tokenizer: Any) -> types.ModelInput:
    """The prompt as the OpenAI routes build it (text only: the playground takes no image)."""
    if form.prompt_format == "chat":
        return routes_openai.chat_prompt(form.model, tokenizer, [{"role": "user", "content": form.prompt}], [])
    return types.ModelInput.from_ints(tokenizer.encode(form.prompt, add_special_tokens=False))


def _decode(tokenizer: Any, seqs: list[types.SampledSequence]) -> list[dict[str, Any]]:
    out = []
    for seq in seqs:
        logprobs = list(seq.logprobs or [None] * len(seq.tokens))
        tokens = [{"id": int(t), "text": tokenizer.decode([int(t)]), "logprob": lp}
                  for t, lp in zip(seq.tokens, logprobs)]
        out.append({"tokens": tokens, "text": tokenizer.decode(list(seq.tokens)), "stop_reason": str(seq.stop_reason)})
    return out
