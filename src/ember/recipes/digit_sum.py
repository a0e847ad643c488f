"""The demo's task: `Sum the digits of 40913:` -> ` 17` + EOS, exact match.

A small labelled set teaches the format (SFT); RL then learns from a verifier on fresh
unlabelled numbers. Held-out numbers are excluded from both, so held-out accuracy
measures generalisation.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

from ember.recipes.rl.env import Environment, Problem

PROMPT_TEMPLATE = "Sum the digits of {n}:"
# Every character the task can produce, for a one-token-per-character tokenizer.
ALPHABET = "".join(sorted(set(PROMPT_TEMPLATE.replace("{n}", "") + " 0123456789")))


def digit_sum(n: int) -> int:
    return sum(int(c) for c in str(n))


def random_number(rng: random.Random, min_digits: int, max_digits: int) -> int:
    """Number of digits uniform in [min_digits, max_digits], then a uniform number of that length."""
    d = rng.randint(min_digits, max_digits)
    return rng.randint(10 ** (d - 1), 10**d - 1)


class DigitSumTask:
    """Encoding of prompts and answers with a given tokenizer, and the fixed data sets."""

    def __init__(self, tokenizer, min_digits: int = 3, max_digits: int = 5) -> None:
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        if tokenizer.eos_token_id is None:
            raise ValueError("the digit-sum task needs a tokenizer with an EOS token")
        self.tokenizer, self.min_digits, self.max_digits = tokenizer, min_digits, max_digits
        self.eos = int(tokenizer.eos_token_id)

    def prompt_tokens(self, n: int) -> list[int]:
        return self.tokenizer.encode(PROMPT_TEMPLATE.format(n=n), add_special_tokens=False)

    def answer_tokens(self, n: int) -> list[int]:
        """` <sum>` followed by EOS: what an exact-match completion must be."""
        return self.tokenizer.encode(f" {digit_sum(n)}", add_special_tokens=False) + [self.eos]

    def problem(self, n: int) -> Problem:
        return Problem(tokens=tuple(self.prompt_tokens(n)), text=PROMPT_TEMPLATE.format(n=n), reference=n)

    def numbers(self, count: int, seed: int, exclude: Iterable[int] = ()) -> list[int]:
        """`count` distinct numbers from `seed`, none of them in `exclude`."""
        rng, seen, out = random.Random(seed), set(exclude), []
        lo, hi = 10 ** (self.min_digits - 1), 10**self.max_digits - 1
        available = hi - lo + 1 - sum(1 for n in seen if lo <= n <= hi)
        if count > available:
            raise ValueError(
                f"cannot draw {count} distinct {self.min_digits}-{self.max_digits} digit numbers: only {available} left"
            )
        while len(out) < count:
            n = random_number(rng, self.min_digits, self.max_digits)
            if n not in seen:
                seen.add(n)
                out.append(n)
        return out

    def labelled_examples(self, numbers: Sequence[int]) -> list[tuple[list[int], list[int]]]:
        """(prompt tokens, answer tokens + EOS) pairs for SFT."""
        return [(self.prompt_tokens(n), self.answer_tokens(n)) for n in numbers]

    def is_correct(self, n: int, completion_tokens: Sequence[int]) -> bool:
        return list(completion_tokens) == self.answer_tokens(n)


PARTIAL_CREDIT = 0.3  # reward of a well-formed but wrong answer with `partial_credit=True`


class DigitSumEnv(Environment):
    """Fresh random numbers as prompts; reward 1 for the exact answer + EOS, else 0.

    With `partial_credit=True` (opt-in; PPO's tests and example use it), a wrong answer that
    still parses as an integer (after dropping the EOS) earns `PARTIAL_CREDIT`: a random
    tiny model then gets a graded signal instead of an almost always zero reward.
    """

    def __init__(self, task: DigitSumTask, exclude: Iterable[int] = (), partial_credit: bool = False) -> None:
        self.task = task
        self.exclude = frozenset(exclude)
        self.partial_credit = bool(partial_credit)

    def sample_problems(self, n: int, rng: random.Random) -> list[Problem]:
        out: list[Problem] = []
        while len(out) < n:
            x = random_number(rng, self.task.min_digits, self.task.max_digits)
            if x not in self.exclude:
                out.append(self.task.problem(x))
        return out

    def reward(self, problem: Problem, completion_tokens: Sequence[int]) -> float:
        if self.task.is_correct(problem.reference, completion_tokens):
            return 1.0
        return PARTIAL_CREDIT if self.partial_credit and self.parses_as_integer(completion_tokens) else 0.0

    def parses_as_integer(self, completion_tokens: Sequence[int]) -> bool:
        """The completion, without a trailing EOS, is an integer such as ` 17` (no sign)."""
        toks = list(completion_tokens)
        if toks and toks[-1] == self.task.eos:
            toks = toks[:-1]
        text = self.task.tokenizer.decode(toks).strip()
        return text.isascii() and text.isdigit()

    def stop(self) -> list[int]:
        return [self.task.eos]


def make_env(tokenizer, partial_credit: bool = False, **task_args) -> DigitSumEnv:
    """The `digit_sum` environment from a recipe's `env_args` (task keys plus `partial_credit`)."""
    return DigitSumEnv(DigitSumTask(tokenizer, **task_args), partial_credit=partial_credit)
