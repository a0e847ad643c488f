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


def _check_sequence(prompt: Sequence[int], completion: Sequence[int]) -> None:
    if len(prompt) < 1:
        raise ValueError("a datum needs at least one prompt token (the first token is never predicted)")
    if len(completion) < 1:
        raise ValueError("a datum needs at least one completion token")


def sft_datum(prompt: Sequence[int], completion: Sequence[int], weight: float = 1.0) -> types.Datum:
    """Cross-entropy datum: completion tokens weighted `weight`, prompt tokens 0."""
    _check_sequence(prompt, completion)
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
    _check_sequence(prompt, completion)
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


def submit_reference_logprobs(reference: Any, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list:
    """One `compute_logprobs(prompt + completion)` per (prompt, completion), all submitted before returning.

    `reference` is any sampling client (ember's in process or the SDK's): a reference model is
    a sampler of a frozen checkpoint. Only the completion's log-probs are asked for
    (`prompt_logprobs_last_n`); read each result with `completion_logprobs`. Returns the
    futures in the order of `sequences`; awaiting them later lets the reference run while
    the caller does other work (e.g. the policy's `forward_backward`).
    """
    for i, (prompt, completion) in enumerate(sequences):
        try:
            _check_sequence(prompt, completion)
        except ValueError as e:
            raise ValueError(f"submit_reference_logprobs: sequence {i}: {e}") from None
    return [
        reference.compute_logprobs(types.ModelInput.from_ints([*prompt, *completion]),
                                   prompt_logprobs_last_n=len(completion))
        for prompt, completion in sequences
    ]


def completion_logprobs(result: Sequence[float | None] | None, prompt_len: int, completion_len: int) -> list[float]:
    """The completion tokens' log-probs from a `compute_logprobs` result over prompt + completion.

    `result[k]` is log p(token k | tokens < k) (None at position 0 and where not scored), so
    the completion's are the last `completion_len` entries; each must be a number.
    """
    if result is None:
        raise ValueError("completion_logprobs: the reference returned no logprobs (None)")
    if len(result) != prompt_len + completion_len:
        raise ValueError(f"completion_logprobs: {len(result)} logprobs for a sequence of {prompt_len} prompt + "
                         f"{completion_len} completion tokens (expected {prompt_len + completion_len})")
    tail = list(result[len(result) - completion_len:]) if completion_len else []
    missing = [k for k, x in enumerate(tail) if x is None]
    if missing:
        raise ValueError(f"completion_logprobs: no logprob for completion token(s) {missing[:8]} "
                         f"(of {completion_len})")
    return [float(x) for x in tail]  # type: ignore[arg-type]


def kl_k1(sampler_logprobs_T: Sequence[float], ref_logprobs_T: Sequence[float]) -> list[float]:
    """Per-token k1 = log q - log p_ref on sampled tokens: its mean estimates KL(q || p_ref)."""
    _check_same_length(sampler_logprobs_T, ref_logprobs_T)
    return [float(q) - float(r) for q, r in zip(sampler_logprobs_T, ref_logprobs_T)]


def kl_k3(sampler_logprobs_T: Sequence[float], ref_logprobs_T: Sequence[float]) -> list[float]:
    """Per-token k3 = exp(r) - 1 - r, r = log p_ref - log q: unbiased, always >= 0, lower variance."""
    _check_same_length(sampler_logprobs_T, ref_logprobs_T)
    return [math.expm1(r) - r for r in (float(p) - float(q) for q, p in zip(sampler_logprobs_T, ref_logprobs_T))]


def _check_same_length(sampler_logprobs_T: Sequence[float], ref_logprobs_T: Sequence[float]) -> None:
    if len(sampler_logprobs_T) != len(ref_logprobs_T):
        raise ValueError(f"KL estimate: {len(sampler_logprobs_T)} sampler logprobs vs "
                         f"{len(ref_logprobs_T)} reference logprobs (expected equal lengths)")


def kl_shaped_advantages(
    advantages_N: Sequence[float], sampler_logprobs_N_T: Sequence[Sequence[float]],
    ref_logprobs_N_T: Sequence[Sequence[float]], kl_coef: float,
) -> list[list[float]]:
    """Per-token advantages A_i + kl_coef * (mean_k1 - k1_it), k1 = log q - log p_ref.

    The k1 penalty is a per-token reward -kl_coef*k1 (tinker-cookbook's
    `incorporate_kl_penalty`); centring on `mean_k1`, the mean over all N sequences'
    tokens, keeps the token-mean of the shaped advantages equal to that of `advantages_N`
    (no drift of the baseline). Ragged: sequence i has its own length T_i.
    """
    if kl_coef < 0 or not math.isfinite(kl_coef):
        raise ValueError(f"kl_shaped_advantages: kl_coef must be a finite number >= 0, got {kl_coef}")
    if not len(advantages_N) == len(sampler_logprobs_N_T) == len(ref_logprobs_N_T):
        raise ValueError(f"kl_shaped_advantages: {len(advantages_N)} advantages, {len(sampler_logprobs_N_T)} "
                         f"sampler and {len(ref_logprobs_N_T)} reference logprob lists (expected equal counts)")
    k1_N_T = [kl_k1(q, p) for q, p in zip(sampler_logprobs_N_T, ref_logprobs_N_T)]
    n_tokens = sum(len(k) for k in k1_N_T)
    mean_k1 = sum(sum(k) for k in k1_N_T) / n_tokens if n_tokens else 0.0
    return [[float(a) + kl_coef * (mean_k1 - k) for k in k1_T] for a, k1_T in zip(advantages_N, k1_N_T)]


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
