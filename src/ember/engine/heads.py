"""Output heads: what a run's model computes per token (docs/architecture.md#roles-one-engine-several-heads).

A training run has one head, chosen by name from `HEADS` (the run's
``user_metadata['ember.head']``, default ``"policy"``):

* ``policy`` — log p_θ(target token) per position from the LM's logits (Tinker's default);
  losses that consume ``"logprobs"`` apply.
* ``value`` — a scalar per position: ``score = Linear(hidden, 1, bias=True)`` on the last
  hidden state (after the final norm), as transformers' ``XForTokenClassification`` with
  ``num_labels=1``; losses that consume ``"values"`` apply (`value_mse`, `ppo_value`, and
  `cross_entropy` as the linear surrogate of ``forward_backward_custom``).

The engine calls the HF model exactly as for a policy (the root module, so FSDP2, TP and
peft hooks stay in play), adding the head's ``model_kwargs``; the value head asks for the
hidden states and only one position of logits (no T×V cost). The head's parameters are
fp32 and replicated on every rank (`ember.engine.torch_engine` sums their gradient over
data-parallel ranks). Their HF names are `hf_state`'s: ``score.weight`` (1, H),
``score.bias`` (1,).
"""

from __future__ import annotations

import abc
import reprlib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
import torch.utils.checkpoint

from ember.engine.batching import MicroBatch
from ember.engine.vocab_parallel import VocabShard, vocab_parallel_target_logprobs
from ember.errors import UserError

HEAD_METADATA_KEY = "ember.head"


class OutputHead(torch.nn.Module, abc.ABC):
    """Turns the HF model's output on one micro-batch into the per-token tensor a loss consumes."""

    name: ClassVar[str]  # the `HEADS` key
    output: ClassVar[str]  # what it outputs, matched against `LossSpec.consumes`
    model_kwargs: ClassVar[Mapping[str, Any]]  # extra kwargs of the HF forward call
    uses_lm_head: ClassVar[bool]  # False: a full-FT run leaves an untied lm_head untrained

    @abc.abstractmethod
    def outputs(self, model_out: Any, mb: MicroBatch, device: torch.device) -> torch.Tensor:
        """fp32 per real token of `mb`, datum by datum: (T,), or (T, K) for top-K log-probs."""

    @abc.abstractmethod
    def zero_contribution(self, model_out: Any) -> torch.Tensor:
        """A scalar equal to 0 whose backward runs the same modules as a real micro-batch."""

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The head's tensors under their transformers names (none for a policy)."""
        return {}

    def bind_unembed(self, unembed: Callable[[torch.Tensor], torch.Tensor],
                     last_hidden: Callable[[Any], torch.Tensor], chunk_tokens: int,
                     vocab: VocabShard | None = None) -> None:
        """The engine hands over the model's LM head (`unembed(hidden) -> logits`, the module
        itself, adapters and autocast included), how to read the last hidden state from the
        model's output, `EngineConfig.logprob_chunk_tokens`, and, when tensor parallelism
        splits lm_head by vocabulary rows, this rank's `VocabShard` (its logits are then a
        (T, V / tp) slice). Heads without lm_head ignore it."""


class PolicyHead(OutputHead):
    """Log-probabilities of the target tokens, from the LM head's logits (fp32 log-softmax).

    With `chunk_tokens` > 0 (`EngineConfig.logprob_chunk_tokens`) the model returns its last
    hidden state only (`logits_to_keep` empty) and the LM head, fp32 log-softmax and target
    gather run `chunk_tokens` rows at a time (`chunked_target_logprobs`): no (T, V) tensor
    is ever held for the micro-batch, in forward or backward. `unembed` is the model's own
    output-embedding module (peft's LoRA wrapper on `lm_head` included), set by the engine.

    With a `vocab` shard (tensor parallelism, `ember.engine.vocab_parallel`) the logits of
    this rank — chunked or not — are its slice of the vocabulary, and the log-softmax runs
    across the TP ranks (`vocab_parallel_target_logprobs`): the vocabulary is never gathered."""

    name, output, uses_lm_head = "policy", "logprobs", True

    def __init__(self) -> None:
        super().__init__()
        self.chunk_tokens = 0
        self.unembed: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.last_hidden: Callable[[Any], torch.Tensor] | None = None
        self.vocab: VocabShard | None = None
        self.chunk_fn: Callable = unembed_target_logprobs

    def use_chunk_fn(self, fn: Callable) -> None:
        """Run `fn` (same signature and values as `unembed_target_logprobs`: the engine's
        compiled version, `ember.engine.compile`) on each chunk instead."""
        self.chunk_fn = fn

    def bind_unembed(self, unembed: Callable[[torch.Tensor], torch.Tensor],
                     last_hidden: Callable[[Any], torch.Tensor], chunk_tokens: int,
                     vocab: VocabShard | None = None) -> None:
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 0:
            raise ValueError(f"logprob_chunk_tokens must be an integer >= 0 (0 = off), got {chunk_tokens!r}")
        self.unembed, self.last_hidden, self.chunk_tokens = unembed, last_hidden, chunk_tokens
        self.vocab = vocab

    @property
    def chunked(self) -> bool:
        return self.chunk_tokens > 0 and self.unembed is not None

    @property
    def model_kwargs(self) -> Mapping[str, Any]:  # type: ignore[override]
        if not self.chunked:
            return {}
        if self.vocab is not None:  # a vocabulary-split lm_head (a DTensor) cannot run on 0 rows: one position
            return {"logits_to_keep": 1}
        # An empty index list: the HF forward runs lm_head on no position at all.
        return {"logits_to_keep": torch.empty(0, dtype=torch.long)}

    def outputs(self, model_out: Any, mb: MicroBatch, device: torch.device) -> torch.Tensor:
        targets = mb.inputs["target_tokens"].to(device)
        index = mb.valid_index.to(device)
        if self.chunked:
            hidden = self.last_hidden(model_out).flatten(0, 1).index_select(0, index)  # (T, H)
            return chunked_target_logprobs(self.unembed, hidden, targets, self.chunk_tokens, self.vocab, self.chunk_fn)
        logits = model_out.logits.flatten(0, 1).index_select(0, index)  # (T, V), or (T, V / tp) under TP
        return _target_logprobs(logits, targets, self.vocab)

    def zero_contribution(self, model_out: Any) -> torch.Tensor:
        if self.chunked:
            return self.unembed(self.last_hidden(model_out)[:, :1]).float().sum() * 0.0
        return model_out.logits.float().sum() * 0.0


def _target_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab: VocabShard | None = None) -> torch.Tensor:
    """log_softmax(logits)[targets] in fp32 (even for bf16 models): (T,) or (T, K); with
    `vocab`, `logits` is this TP rank's slice and the softmax spans every rank's."""
    if vocab is not None:
        return vocab_parallel_target_logprobs(logits, targets, vocab)
    logp = torch.log_softmax(logits.float(), dim=-1)
    if targets.dim() == 1:
        return logp.gather(1, targets.unsqueeze(1)).squeeze(1)
    return logp.gather(1, targets)


def unembed_target_logprobs(unembed: Callable, hidden: torch.Tensor, targets: torch.Tensor,
                            vocab: VocabShard | None) -> torch.Tensor:
    """One chunk of the policy head: log_softmax(unembed(hidden))[targets] in fp32."""
    return _target_logprobs(unembed(hidden), targets, vocab)


def chunked_target_logprobs(
    unembed: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
    vocab: VocabShard | None = None, chunk_fn: Callable = unembed_target_logprobs,
) -> torch.Tensor:
    """log_softmax(unembed(hidden))[targets] for hidden (T, H), `chunk_tokens` rows at a time
    (`vocab`: `unembed` gives this TP rank's vocabulary slice; see `_target_logprobs`), each
    chunk by `chunk_fn` (`unembed_target_logprobs`, or its compiled version).

    Under autograd each chunk is a non-reentrant `torch.utils.checkpoint`: forward keeps
    only the chunk's (T_c,) output, backward recomputes that chunk's logits, so the peak is
    one chunk's (T_c, V) logits and their fp32 log-softmax and gradient. Row-wise ops only,
    so the values equal the unchunked path's (same matmul rows, same reductions)."""
    parts = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if torch.is_grad_enabled():
            parts.append(torch.utils.checkpoint.checkpoint(chunk_fn, unembed, h, t, vocab,
                                                           use_reentrant=False))
        else:
            parts.append(chunk_fn(unembed, h, t, vocab))
    if not parts and vocab is not None:  # no real token; a vocabulary-split lm_head cannot run on 0 rows
        return torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device) + hidden.float().sum() * 0.0
    if not parts:  # no real token: keep the output's shape and graph
        return unembed_target_logprobs(unembed, hidden, targets, vocab)
    return torch.cat(parts)


class ValueHead(OutputHead):
    """V_t = score(h_t): a fp32 `Linear(hidden, 1)` on the last hidden state.

    Initialised from `seed` with weight ~ N(0, 1/H) and bias 0: non-zero, so that with a
    fresh LoRA adapter (B = 0) the adapter still gets a gradient through the head."""

    name, output, uses_lm_head = "value", "values", False
    # hidden states for the head; logits for one position only (lm_head is not used)
    model_kwargs = {"output_hidden_states": True, "logits_to_keep": 1}

    def __init__(self, hidden_size: int, seed: int) -> None:
        super().__init__()
        if hidden_size < 1:
            raise ValueError(f"a value head needs hidden_size >= 1, got {hidden_size}")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.score = torch.nn.Linear(hidden_size, 1, bias=True, dtype=torch.float32)
            torch.nn.init.normal_(self.score.weight, std=hidden_size**-0.5)
            torch.nn.init.zeros_(self.score.bias)

    def _values(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.score(hidden.float()).squeeze(-1)  # fp32 head even under bf16 / autocast

    def outputs(self, model_out: Any, mb: MicroBatch, device: torch.device) -> torch.Tensor:
        hidden = model_out.hidden_states[-1].flatten(0, 1).index_select(0, mb.valid_index.to(device))  # (T, H)
        return self._values(hidden)

    def zero_contribution(self, model_out: Any) -> torch.Tensor:
        return self._values(model_out.hidden_states[-1]).sum() * 0.0

    def hf_state(self) -> dict[str, torch.Tensor]:
        return {f"score.{n}": t.detach().clone() for n, t in self.score.state_dict().items()}


def _hidden_size(hf_config: Any) -> int:
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return int(text.hidden_size)


HEADS: dict[str, Callable[[Any, int], OutputHead]] = {
    "policy": lambda hf_config, seed: PolicyHead(),  # the engine sets its chunking (`OutputHead.bind_unembed`)
    "value": lambda hf_config, seed: ValueHead(_hidden_size(hf_config), seed),
}
HEAD_OUTPUTS: dict[str, str] = {"policy": PolicyHead.output, "value": ValueHead.output}


def _check_name(name: object, field: str) -> str:
    known = ", ".join(HEADS)
    if not isinstance(name, str):
        raise UserError(f"{field} must be a string, one of {known}; got {type(name).__name__} {reprlib.repr(name)}")
    if name not in HEADS:
        raise UserError(f"{field} must be one of {known}; got {reprlib.repr(name)}")
    return name


def build_head(name: str, hf_config: Any, seed: int = 0) -> OutputHead:
    """The head registered as `name` for a model with `hf_config`; ValueError listing the known heads."""
    return HEADS[_check_name(name, "head")](hf_config, int(seed))


def head_output(name: str) -> str:
    """What head `name` outputs per token ("logprobs" | "values")."""
    return HEAD_OUTPUTS[_check_name(name, "head")]


def head_from_metadata(meta: Mapping[str, Any] | None) -> str:
    """The head a run's ``user_metadata`` asks for: ``"policy"`` when absent.

    UserError naming ``user_metadata['ember.head']``, the known heads and what was got,
    for a value that is not a known head name (wrong type included)."""
    if meta is None or HEAD_METADATA_KEY not in meta:
        return "policy"
    return _check_name(meta[HEAD_METADATA_KEY], f"user_metadata[{HEAD_METADATA_KEY!r}]")
