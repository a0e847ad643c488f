"""Log-probabilities over a vocabulary split across tensor-parallel ranks (docs/architecture.md#runtimes-and-scale).

Under `ParallelismConfig.tp > 1` an untied `lm_head` is split by vocabulary rows
(`ember.engine.parallel.apply_tp`): TP rank r holds rows `[r * ceil(V/tp), ...)` of the
weight, torch.chunk's split (DTensor `Shard(0)`; the last shard is the short one when `tp`
does not divide V), and the LM head's output on that rank is its (T, V_r) slice of the
logits. `vocab_parallel_target_logprobs` turns those slices into log p(target) without
ever gathering the vocabulary: per row, an all-reduce MAX of the slice maxima, an
all-reduce SUM of exp(logit - max), and the target's logit from the rank that owns it
(the others add 0) in a third all-reduce — three (T,)-sized collectives.

Backward needs no collective: d logp(t) / d logit_v = [v == t] - softmax_v, computed on
the local slice only. The hidden state's gradient is the SUM over TP ranks of what each
slice contributes; the LM head's `ColwiseParallel` input (a `Replicate` DTensor made
from the local hidden state) all-reduces it in backward, and the weight's gradient stays
the local slice's (`Shard(0)`), so no (T, V) tensor exists on any rank, in forward or
backward, and the chunked policy head (`ember.engine.heads.chunked_target_logprobs`)
keeps its (chunk, V / tp) peak.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class VocabShard:
    """Where this rank's logits sit in the vocabulary: rows `[offset, offset + rows)` of `vocab`."""

    group: "dist.ProcessGroup"
    rank: int  # this rank's index in the tensor-parallel group
    size: int  # the tensor-parallel degree
    vocab: int  # the full vocabulary

    @property
    def offset(self) -> int:
        return self.rank * shard_rows(self.vocab, self.size)

    @property
    def rows(self) -> int:
        return max(0, min(shard_rows(self.vocab, self.size), self.vocab - self.offset))


def shard_rows(vocab: int, tp: int) -> int:
    """Rows of the first (largest) vocabulary shard: torch.chunk's ceil(V / tp)."""
    return -(-vocab // tp)


def check_vocab_split(vocab: int, tp: int) -> None:
    """ValueError when a split of `vocab` rows into ceil(V/tp)-row shards leaves a rank empty."""
    if shard_rows(vocab, tp) * (tp - 1) >= vocab:
        raise ValueError(f"tp={tp} cannot split a vocabulary of {vocab} tokens into {tp} non-empty shards of "
                         f"ceil({vocab}/{tp})={shard_rows(vocab, tp)} rows; use a smaller tp")


class _TargetLogprobs(torch.autograd.Function):
    """log_softmax over all ranks' slices, at `targets`: (T,) or (T, K)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, shard: VocabShard) -> torch.Tensor:
        if logits.shape[-1] != shard.rows:
            raise ValueError(f"TP rank {shard.rank} holds {logits.shape[-1]} vocabulary rows of the logits; "
                             f"a split of {shard.vocab} over {shard.size} ranks gives it {shard.rows}")
        two_d = targets if targets.dim() == 2 else targets.unsqueeze(1)
        peak = logits.amax(dim=-1)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=shard.group)
        sum_exp = torch.exp(logits - peak.unsqueeze(1)).sum(dim=-1)
        dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=shard.group)
        log_z = peak + torch.log(sum_exp)
        local = two_d - shard.offset
        owned = (local >= 0) & (local < shard.rows)
        local = local.clamp(0, shard.rows - 1)
        picked = torch.where(owned, logits.gather(1, local), logits.new_zeros(()))
        dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=shard.group)
        ctx.save_for_backward(logits, log_z, local, owned)
        ctx.two_d = targets.dim() == 2
        out = picked - log_z.unsqueeze(1)
        return out if ctx.two_d else out.squeeze(1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, log_z, local, owned = ctx.saved_tensors
        g = grad if ctx.two_d else grad.unsqueeze(1)
        out = torch.exp(logits - log_z.unsqueeze(1)) * -g.sum(dim=1, keepdim=True)  # -softmax · Σ_k g_k
        out.scatter_add_(1, local, torch.where(owned, g, g.new_zeros(())))  # + g at owned targets
        return out, None, None


def vocab_parallel_target_logprobs(logits: torch.Tensor, targets: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """log_softmax(full logits)[targets] in fp32, from this rank's (T, V_r) slice of the logits;
    `targets` (T,) or (T, K) hold global token ids. Every rank of `shard.group` must call it
    on the same rows (collective); they all get the same result."""
    return _TargetLogprobs.apply(logits.float(), targets, shard)
