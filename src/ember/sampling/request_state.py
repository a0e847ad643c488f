"""`RequestState`: the scheduler's record of one request in flight.

A `Job` is what the caller asked (it never changes); a `RequestState` is how far the
scheduler has got with it: which samples have a slot, which are finished, the prompt's
last logits and KV kept for samples placed in a later step, and the prompt scores the
response returns. Only the scheduler (on the sampler's worker thread) creates and
changes one, through the methods below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from tinker import types
from tinker.types.topk_logprobs import TopkLogprobs

from ember import failpoints
from ember.sampling import jobs, rng
from ember.sampling.jobs import Job
from ember.sampling.params import ResolvedRequest
from ember.sampling.prefix_cache import Snapshot
from ember.sampling.prompt_logits import PromptLogits


@dataclass
class PromptScores:
    """What the response reports about the prompt itself (None: not asked for)."""

    logprobs: np.ndarray | None = None  # [P], NaN where not scored
    top_logprobs: TopkLogprobs | None = None
    target_logprobs: types.TensorData | None = None
    alt_tokens: types.PromptAltTokens | None = None


@dataclass(eq=False)
class RequestState:
    job: Job
    spec: ResolvedRequest = field(init=False)  # job.spec (read on every step: a plain attribute)
    sample_keys: np.ndarray = field(init=False)  # [num_samples] RNG key of each sample
    samples_placed: int = 0  # samples [0, samples_placed) have had a slot
    samples_done: int = 0
    failed: bool = False  # failed alone mid-step (Scheduler._fail_request): its remaining rows are skipped
    last_logits_V: torch.Tensor | None = None  # logits after the prompt: every sample's first token
    prompt_kv: Snapshot | None = None  # the prompt's KV, for samples placed in a later step
    prompt_scores: PromptScores = field(default_factory=PromptScores)
    cache_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prompt_routes: np.ndarray | None = None  # MoE: the prompt's (P, layers, k) experts, -1 where not run
    sequences: list[types.SampledSequence | None] = field(init=False)

    def __post_init__(self) -> None:
        self.spec = self.job.spec
        self.sample_keys = rng.sample_keys(self.spec.seed, self.spec.num_samples)
        self.sequences = [None] * self.spec.num_samples

    @property
    def samples_unplaced(self) -> int:
        return self.spec.num_samples - self.samples_placed

    def place(self, count: int) -> range:
        """The next `count` samples get slots: their indices."""
        first = self.samples_placed
        self.samples_placed += count
        return range(first, first + count)

    def keep_last_logits(self, logits_T_V: PromptLogits) -> None:
        """Keep the logits after the prompt's last token (every sample's first draw)."""
        self.last_logits_V = logits_T_V.last()  # not a view: the batch's logits are freed

    def score_prompt(self, logits_T_V: PromptLogits) -> None:
        """Prompt logprobs, top-k and extras from the logits of the prompt positions (the
        last P rows; held, or computed chunk by chunk from hidden states)."""
        spec = self.spec
        prompt_logits_P_V = logits_T_V.slice(-len(spec.prompt))
        scores = self.prompt_scores
        if spec.include_prompt_logprobs or spec.topk_prompt_logprobs > 0:
            failpoints.hit("sampler.score_prompt", key=" ".join(map(str, spec.sequence_ids)))
            scores.logprobs, scores.top_logprobs = jobs.prompt_scores(prompt_logits_P_V, spec.prompt, spec)
        scores.target_logprobs, scores.alt_tokens = jobs.prompt_extras(prompt_logits_P_V, spec)

    def fail(self) -> None:
        self.failed = True
        self.last_logits_V = self.prompt_kv = None

    def finish_sample(self, sample: int, sequence: types.SampledSequence) -> bool:
        """Store one finished sequence; True when the whole request is done."""
        self.sequences[sample] = sequence
        self.samples_done += 1
        if self.samples_done == self.spec.num_samples:
            self.last_logits_V = None
            return True
        return False

    def response(self) -> types.SampleResponse:
        scores = self.prompt_scores
        return types.SampleResponse(
            sequences=list(self.sequences),
            prompt_logprobs_np=scores.logprobs if self.spec.include_prompt_logprobs else None,
            topk_prompt_logprobs_np=scores.top_logprobs,
            target_prompt_logprobs=scores.target_logprobs,
            prompt_alt_tokens=scores.alt_tokens,
            prompt_cache_hit_tokens=self.cache_hit_tokens,
        )
