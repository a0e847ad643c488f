"""A sampling request (`Job`) and the pure functions that turn its results into
tinker's `SampleResponse`."""

from __future__ import annotations

from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

import numpy as np
import torch
from tinker import types
from tinker.types.topk_logprobs import MASK_LOGPROB, TopkLogprobs

from ember.sampling.prompt_extras import ROW_CHUNK
from ember.sampling.prompt_extras import compute as compute_prompt_extras
from ember.sampling.params import ResolvedRequest
from ember.sampling.prompt_logits import PromptLogits
from ember.sampling.vision import PromptImages
from ember.sampling.weights import TorchWeightVersion


@dataclass(frozen=True, eq=False)
class Job:
    """A sampling request as TorchSampler accepted it: what was asked, where to answer, and
    on which weights. The scheduler keeps its progress apart (`request_state.RequestState`)."""

    spec: ResolvedRequest
    future: Future
    version: TorchWeightVersion | None
    images: PromptImages | None = None  # the prompt's images (`sampling/vision.py`), None: text only
    cache_prompt: tuple[int, ...] | None = None  # the prefix cache's view of the prompt (images by digest)

    @property
    def prefix_tokens(self) -> tuple[int, ...]:
        """What the prefix cache compares: the prompt, each image run as its image's id."""
        return self.cache_prompt if self.cache_prompt is not None else self.spec.prompt

    @property
    def full_version_id(self) -> int:
        """The full fine-tuning version the forward runs with; 0 = the base module (and its LoRA hooks)."""
        version = self.version
        return version.version_id if version is not None and not version.is_lora else 0

    @property
    def lora_version_id(self) -> int:
        """The LoRA adapter version applied by hooks on the base module; 0 = none."""
        version = self.version
        return version.version_id if version is not None and version.is_lora else 0

    @property
    def on_tokens(self):
        """The request's token callback (`SamplingRequest.on_tokens`; None: not streamed)."""
        return self.spec.request.on_tokens

    @property
    def owner(self) -> str:
        """The tenant this request is served for (`SamplingRequest.owner`)."""
        return self.spec.request.owner

    @property
    def cache_key(self) -> tuple[str, int, int]:
        """The prefix cache's key: whose request, on which weights (a hit never crosses owners)."""
        return self.owner, self.full_version_id, self.lora_version_id


def settle(future: Future, result=None, error: BaseException | None = None) -> None:
    """Give `future` its result or error unless it is already done (cancelled by its caller)."""
    if future.done():
        return
    try:
        future.set_exception(error) if error is not None else future.set_result(result)
    except InvalidStateError:  # cancelled in between, from another thread
        pass


def topk_matrix(rows: list[tuple[np.ndarray, np.ndarray] | None], k: int) -> TopkLogprobs:
    """Dense (len, k) matrices; missing rows and cells hold the SDK's sentinel (0, -99999).

    Tokens of probability 0 (-inf: outside a processed distribution's support) are left out.
    """
    ids = np.zeros((len(rows), k), np.int32)
    lps = np.full((len(rows), k), MASK_LOGPROB, np.float32)
    for i, row in enumerate(rows):
        if row is not None:
            keep = np.isfinite(row[1][:k])
            n = int(keep.sum())
            ids[i, :n], lps[i, :n] = row[0][:k][keep], row[1][:k][keep]
    return TopkLogprobs(token_ids=ids, logprobs=lps)


def prompt_scores(
    logits: torch.Tensor | PromptLogits, prompt: tuple[int, ...], spec: ResolvedRequest, chunk_rows: int = ROW_CHUNK
) -> tuple[np.ndarray, TopkLogprobs | None]:
    """Prompt logprobs (NaN where not scored) and top-k rows from the prompt's logits [P, V]
    (held, or computed from hidden states chunk by chunk: `PromptLogits`).

    The fp32 log-softmax runs `chunk_rows` positions at a time (a hidden source's own
    chunk instead; row-wise, so equal to one pass over all rows): a long prompt never
    holds a second, fp32 (P, V) tensor, and a hidden source never a first one."""
    source = PromptLogits.of(logits)
    step = source.step(chunk_rows)
    p = len(prompt)
    first = 1 if spec.prompt_logprobs_last_n is None else p - spec.prompt_logprobs_last_n
    k = min(spec.topk_prompt_logprobs, source.vocab_size)
    scored, top_ids, top_vals = [], [], []
    for start in range(first - 1, p - 1, step):
        stop = min(start + step, p - 1)
        logp = torch.log_softmax(source.rows(start, stop).float(), dim=-1)
        targets = torch.tensor(prompt[start + 1 : stop + 1], device=logp.device)
        scored.append(logp.gather(1, targets[:, None]).squeeze(1).cpu().numpy())
        if k > 0:
            vals, ids = torch.topk(logp, k, dim=-1)
            top_ids.append(ids.cpu().numpy())
            top_vals.append(vals.cpu().numpy())
    out = np.full(p, np.nan, np.float32)
    if scored:
        out[first:] = np.concatenate(scored)
    topk = None
    if spec.topk_prompt_logprobs > 0:
        ids_np = np.concatenate(top_ids) if top_ids else np.zeros((0, k), np.int64)
        vals_np = np.concatenate(top_vals) if top_vals else np.zeros((0, k), np.float32)
        rows = [None] * first + [(ids_np[i], vals_np[i]) for i in range(p - first)]
        topk = topk_matrix(rows, spec.topk_prompt_logprobs)
    return out, topk


def prompt_extras(logits: torch.Tensor | PromptLogits, spec: ResolvedRequest):
    """(target_prompt_logprobs, prompt_alt_tokens) from the prompt's logits [P, V] (or `PromptLogits`)."""
    if spec.targets is None and spec.prompt_alt_tokens_k == 0:
        return None, None
    return compute_prompt_extras(PromptLogits.of(logits).slice(None, len(spec.prompt) - 1), spec.targets,
                                 spec.prompt_alt_tokens_k, spec.temperature, spec.seed)


def sampled_sequence(
    tokens: np.ndarray, logprobs: np.ndarray, topk_rows: list | None, k: int, stop: bool, sequence_id: str
) -> types.SampledSequence:
    return types.SampledSequence(
        stop_reason="stop" if stop else "length",
        sequence_id=sequence_id,
        tokens_np=tokens.astype(np.int32, copy=True),
        logprobs_np=logprobs.astype(np.float32, copy=True),
        topk_logprobs_np=topk_matrix(topk_rows, k) if k > 0 else None,
    )
