"""Pieces shared by the recipes: datum construction (Tinker alignment), LR schedules, clients.

Alignment (tinker-cookbook): for a sequence `tokens = prompt + completion`,
`model_input = tokens[:-1]` and `target_tokens = tokens[1:]`; position i predicts token
i+1, so every per-token input (`weights`, `logprobs`, `advantages`) has length
`len(tokens) - 1` and the first `len(prompt) - 1` positions belong to the prompt.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tinker import types

StepHook = Callable[[int, dict[str, float]], None]  # (step, that step's reduced metrics)
Evaluator = Callable[[Any, int], dict[str, float]]  # (sampling client, steps done) -> metrics
Schedule = Literal["constant", "linear", "cosine"]
SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine")
RL_LOSSES: tuple[str, ...] = ("importance_sampling", "ppo")  # the losses the GRPO recipe can use


def check_sequence(prompt: Sequence[int], completion: Sequence[int]) -> None:
    if len(prompt) < 1:
        raise ValueError("a datum needs at least one prompt token (the first token is never predicted)")
    if len(completion) < 1:
        raise ValueError("a datum needs at least one completion token")


def sft_datum(prompt: Sequence[int], completion: Sequence[int], weight: float = 1.0) -> types.Datum:
    """Cross-entropy datum: completion tokens weighted `weight`, prompt tokens 0."""
    check_sequence(prompt, completion)
    tokens = [*prompt, *completion]
    weights = [0.0] * (len(prompt) - 1) + [float(weight)] * len(completion)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def rl_datum(
    prompt: Sequence[int], completion: Sequence[int], sampler_logprobs: Sequence[float],
    advantage: float | Sequence[float],
) -> types.Datum:
    """Policy-gradient datum: sampler logprobs and the advantage on completion positions, 0 on the prompt.

    `advantage` is one float for every completion token (GRPO), or a per-token list of
    length `len(completion)` (KL-shaped or GAE advantages).
    """
    check_sequence(prompt, completion)
    if len(sampler_logprobs) != len(completion):
        raise ValueError(
            f"rl_datum: {len(sampler_logprobs)} sampler logprobs for {len(completion)} completion tokens"
        )
    tokens = [*prompt, *completion]
    pad = [0.0] * (len(prompt) - 1)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": pad + [float(x) for x in sampler_logprobs],
            "advantages": pad + _token_advantages(advantage, len(completion)),
        },
    )


def _token_advantages(advantage: float | Sequence[float], n_tokens: int) -> list[float]:
    if isinstance(advantage, numbers.Real):
        return [float(advantage)] * n_tokens
    if isinstance(advantage, (str, bytes)) or not isinstance(advantage, Sequence):
        raise TypeError(f"rl_datum: advantage must be a float or a per-token sequence of floats, "
                        f"got {type(advantage).__name__}")
    if len(advantage) != n_tokens:
        raise ValueError(f"rl_datum: advantage has {len(advantage)} per-token values for {n_tokens} "
                         f"completion tokens (expected {n_tokens})")
    return [float(a) for a in advantage]


def learning_rate_at(step: int, total_steps: int, base_lr: float, schedule: str, min_ratio: float = 0.0) -> float:
    """LR of optimizer step `step` (0-based) out of `total_steps`; decays towards base_lr*min_ratio."""
    if schedule == "constant" or total_steps <= 1:
        return base_lr
    frac = min(max(step / (total_steps - 1), 0.0), 1.0)
    if schedule == "linear":
        decay = 1.0 - frac
    elif schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * frac))
    else:
        raise ValueError(f"unknown lr schedule {schedule!r}; expected constant, linear or cosine")
    return base_lr * (min_ratio + (1.0 - min_ratio) * decay)


@dataclass
class ClientConfig:
    """How a recipe reaches ember: in process (default) or over HTTP with the official SDK.

    base_url: empty = in-process `ember.ServiceClient(models=...)`; else an `ember serve`
        (or Tinker) URL used through `tinker.ServiceClient(base_url=..., api_key=...)`.
    api_key: for HTTP; must start with "tml-" (defaults to $TINKER_API_KEY).
    models: in-process base models, name -> local HF directory.
    data_dir: in-process checkpoint/database directory (empty = ember's default).
    """

    base_url: str = ""
    api_key: str = ""
    models: dict[str, str] = field(default_factory=dict)
    data_dir: str = ""


class ServerUnreachable(RuntimeError):
    """Nothing answers at the configured base_url (raised before the SDK's retry loop)."""


def check_reachable(base_url: str, timeout_s: float = 5.0) -> None:
    """Fail within seconds when no server listens at `base_url`.

    The SDK retries a refused connection for minutes without a word; a recipe pointed at a
    server that is not running should say so at once. Any HTTP answer (even a 404 from a
    server without `/api/v1/healthz`) counts as reachable: only the connection is checked.
    """
    import httpx

    url = base_url.rstrip("/") + "/api/v1/healthz"
    try:
        httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise ServerUnreachable(
            f"no server answers at {base_url} ({type(e).__name__}: {e or 'no answer'}); start one with "
            f"`ember serve --model NAME=DIR --port PORT`, or leave client.base_url empty to train in process"
        ) from None


def make_service_client(config: ClientConfig) -> Any:
    """A Tinker ServiceClient: ember's in-process one, or the official SDK's over HTTP."""
    if config.base_url:
        import os

        import tinker

        api_key = config.api_key or os.environ.get("TINKER_API_KEY", "")
        check_reachable(config.base_url)
        return tinker.ServiceClient(base_url=config.base_url, api_key=api_key)
    import ember

    kwargs: dict[str, Any] = {"models": dict(config.models)}
    if config.data_dir:
        kwargs["data_dir"] = config.data_dir
    return ember.ServiceClient(**kwargs)
