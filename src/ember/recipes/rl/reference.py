"""A reference model's log-probs of sampled completions: the KL term of GRPO and PPO.

A reference model is a sampler of a frozen checkpoint (contract 4 of docs/architecture.md:
immutable), asked for `compute_logprobs`; by default the policy's step-0 weights.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from tinker import types

from ember.recipes.common import check_sequence


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
            check_sequence(prompt, completion)
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


def save_step0_reference(training_client) -> str:
    """Save the policy's current weights for sampling (`save_weights_for_sampler`); returns the path."""
    name = f"grpo-kl-reference-{uuid.uuid4().hex[:12]}"
    return training_client.save_weights_for_sampler(name).result().path


def step0_reference(training_client) -> Any:
    """A sampler of the policy's current weights, saved so that it outlives the service's cap on
    in-memory snapshots per session: evicted, it reloads from disk."""
    return training_client.create_sampling_client(save_step0_reference(training_client)).result()
