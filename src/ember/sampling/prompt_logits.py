"""`PromptLogits`: the logits of a prompt's positions, held whole or computed chunk by chunk.

A request that scores its prompt (`compute_logprobs`, prompt logprobs and their top-k,
`target_prompt_logprobs`, `prompt_alt_tokens_k`) needs the next-token distribution at
every prompt position: P x V values, 20 GB in fp32 for a 32k-token prompt on a 151,936-token
vocabulary. With `SamplerConfig.logprob_chunk_tokens` > 0 (by default the engine's
`EngineConfig.logprob_chunk_tokens`) the TorchSampler's prefill returns the decoder's last
hidden states [P, H] instead (`ModelRunner.forward(..., hidden=True)`), and the scorers
(`ember.sampling.jobs.prompt_scores`, `ember.sampling.prompt_extras.compute`) ask for
`chunk_rows` rows of logits at a time: the LM head, with the request's own weights (full
version, LoRA delta on lm_head), runs per chunk (`ModelRunner.unembed`), and each chunk
is freed before the next. Only row-wise operations, so the values equal the held path's;
the training side does the same per micro-batch (`ember.engine.heads.chunked_target_logprobs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptLogits:
    """Logits [N, V] of N prompt positions: `source` itself (`unembed` None), or
    `unembed(source[rows])` of the hidden states `source` [N, H], `chunk_rows` rows at a time."""

    source: torch.Tensor
    unembed: Callable[[torch.Tensor], torch.Tensor] | None = None
    chunk_rows: int | None = None  # a hidden source's chunk; None: the scorer's own row chunk
    vocab_size: int = 0  # V (a held source's width when 0)

    @classmethod
    def of(cls, logits: "torch.Tensor | PromptLogits") -> "PromptLogits":
        """A held logits tensor [N, V] wrapped; a `PromptLogits` as it is."""
        return logits if isinstance(logits, PromptLogits) else cls(logits, vocab_size=int(logits.shape[-1]))

    @classmethod
    def from_hidden(cls, hidden: torch.Tensor, unembed: Callable[[torch.Tensor], torch.Tensor], chunk_rows: int,
                    vocab_size: int) -> "PromptLogits":
        if chunk_rows < 1:
            raise ValueError(f"PromptLogits: chunk_rows must be >= 1, got {chunk_rows}")
        return cls(hidden, unembed, chunk_rows, vocab_size)

    def __len__(self) -> int:
        return int(self.source.shape[0])

    @property
    def held(self) -> bool:
        return self.unembed is None

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """The logits of positions [start, stop): a view of a held source, else one LM-head call."""
        part = self.source[start:stop]
        return part if self.unembed is None else self.unembed(part)

    def step(self, default_rows: int) -> int:
        """Rows per chunk for a scorer whose own chunk is `default_rows`."""
        return self.chunk_rows or default_rows

    def last(self) -> torch.Tensor:
        """The logits after the last position [V] (a copy: the batch's tensors are freed)."""
        n = len(self)
        return self.rows(n - 1, n)[0].clone()

    def slice(self, start: int | None = None, stop: int | None = None) -> "PromptLogits":
        """Positions [start, stop) (Python slice semantics), still lazy."""
        return dataclasses.replace(self, source=self.source[start:stop])
