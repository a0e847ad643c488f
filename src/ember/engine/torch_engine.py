"""`TorchEngine`: a Hugging Face causal LM (full fine-tuning or a LoRA adapter) + its optimizer
(AdamW by default, or Dimuon: `ember.engine.optimizers`).

Exactness is the point (docs/architecture.md contract 2): a `forward_backward` adds
∇ Σ_datums loss(datum) to the parameters' `.grad`, micro-batch by micro-batch, with no
scaling, so any micro-batch budget, packing or split over calls gives the same gradient.
The model always runs in eval mode (no dropout), like Tinker, so `forward`,
`forward_backward` and the sampler see the same function.

The run's head (`ember.engine.heads`: "policy" or "value") decides what is computed per
token — log-probs of the targets, or a scalar value — and which losses apply. The
per-token outputs come back under ``loss_fn_outputs[i]["logprobs"]`` either way (where
the SDK reads them): values for a value head.
"""
# ember: single-process engine complete

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from peft import PeftModel, get_peft_model_state_dict
from tinker import types
from transformers import PreTrainedModel

from ember.engine import checkpoint
from ember.engine.base import EngineInfo, EngineStatus, LossConfig, NonFiniteGradientError, TrainingEngine
from ember.engine.batching import (
    MicroBatch,
    PreparedDatum,
    build_micro_batch,
    head_mismatch,
    packed_masks,
    plan_micro_batches,
    prepare_datums,
)
from ember.engine.config import EngineConfig
from ember.engine.heads import OutputHead, PolicyHead, build_head, head_output, unembed_target_logprobs
from ember.engine.moe import ROUTES_KEY, RoutingStats, flat_routes, moe_routing, split_routes
from ember.engine.optimizers import Optimizer, build_optimizer
from ember.engine.parallel import ParallelismConfig, apply_activation_checkpointing, decoder_layers, hf_model
from ember.errors import UserError
from ember.losses import get_loss, resolve_config
from ember.models import add_lora_adapter, load_model, resolve_dtype
from ember.models.batch_invariant import batch_invariant, use_batch_invariant_attention
from ember.models.families import family_of, linear_attention_layers, vision_of
from ember.models.vision import VisionSpec, load_vision_spec

if TYPE_CHECKING:
    from ember.engine.parallel import ParallelContext

DEFAULT_ADAPTER = "default"


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    # DTensor (FSDP2/TP) → gather the full tensor; plain tensors pass through.
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _last_hidden(model_out) -> torch.Tensor:
    """The decoder's last hidden state that `TorchEngine._model_forward` captured."""
    return model_out.ember_last_hidden


class TorchEngine(TrainingEngine):
    """One trainable model and its optimizer, in one process or as one rank of an SPMD group.

    Parallel layouts (FSDP2 / HSDP / TP, `ember.engine.parallel`) plug in below the same
    interface: pass `parallel` (a `ParallelContext`) with a model already parallelised by
    `parallelize_model`, or use `from_pretrained(..., parallelism=...)`. Each data-parallel
    rank then gets its own datums (the workers' `mesh` dispatch); ranks agree on validation
    and on the number of micro-batches before any collective, and a rank with fewer
    micro-batches runs zero-contribution padding passes, so the summed gradient is exact.
    """

    def __init__(
        self,
        model: PreTrainedModel | PeftModel,
        config: EngineConfig | None = None,
        *,
        model_name: str = "model",
        lora_config: types.LoraConfig | None = None,
        adapter_name: str = DEFAULT_ADAPTER,
        parallel: "ParallelContext | None" = None,
        optimizer_config: types.OptimizerConfig | dict | None = None,
        head: str = "policy",
        vision: VisionSpec | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.parallel = parallel
        self.model = model
        self.vision = vision if vision is not None else self._load_vision(model)
        self.model_name = model_name
        self.lora_config = lora_config
        self.adapter_name = adapter_name if lora_config is not None else None
        if lora_config is not None and not isinstance(model, PeftModel):
            raise TypeError("a LoRA TorchEngine needs a PeftModel carrying its adapter (see ember.models.add_lora_adapter)")
        self.model.eval()  # no dropout: trainer, forward and sampler compute the same function
        self._activate()
        if self.config.float8:
            self._check_float8()
        seed = lora_config.seed if lora_config is not None and lora_config.seed is not None else self.config.seed
        self.head: OutputHead = build_head(head, self.hf_config, seed).to(self.device)
        vocab = self.parallel.vocab_shard(self.model) if self.distributed else None
        self.head.bind_unembed(self._unembed, _last_hidden, self.config.logprob_chunk_tokens, vocab)
        if self.config.activation_checkpointing:
            apply_activation_checkpointing(self.model)  # idempotent: a shared base or a mesh may have it
        self._params = self._trainable_parameters()
        # a mixture-of-experts model's routing metrics and auxiliary loss (ember.engine.moe)
        self._routing = moe_routing(self.model, self.hf_config, self.config.moe_aux_loss_coef)
        self.optimizer_config = optimizer_config
        self.optimizer = self._new_optimizer()
        self._step = 0
        self._acc = EngineStatus(step=0, accumulated_micro_batches=0, accumulated_datums=0, accumulated_tokens=0)
        self.compile_stats = self._compile() if self.config.compile else None

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | os.PathLike,
        config: EngineConfig | None = None,
        lora_config: types.LoraConfig | None = None,
        model_name: str | None = None,
        parallelism: "ParallelismConfig | None" = None,
        optimizer_config: types.OptimizerConfig | dict | None = None,
        head: str = "policy",
    ) -> "TorchEngine":
        """Load a local HF checkpoint; wrap it with a fresh LoRA adapter when `lora_config` is given.

        With `parallelism` (world size > 1, torch.distributed initialised — see
        `ember.workers`), build the DeviceMesh and lay the model out on it. `head` names the
        run's output head (`ember.engine.heads.HEADS`); a value head's LoRA adapter never
        targets `lm_head`, which it does not use.
        """
        config = config or EngineConfig()
        head_output(head)  # an unknown head is refused before the model is loaded
        if parallelism is not None and parallelism.cp > 1 and config.attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"ParallelismConfig.cp={parallelism.cp} runs its own (sdpa) attention over all-to-all; "
                             f"EngineConfig.attn_implementation must be 'sdpa' or 'eager', got {config.attn_implementation!r}")
        if config.batch_invariant and parallelism is not None and parallelism.world_size > 1:
            raise ValueError(f"EngineConfig.batch_invariant runs on one device: a layout of {parallelism.world_size} "
                             f"ranks splits rows and reductions across ranks (FSDP2/TP/CP collectives)")
        if config.float8:
            from ember.engine.float8 import check_lora

            check_lora(lora_config is not None)
        model = load_model(model_dir, config.dtype, config.device, config.attn_implementation)
        if config.batch_invariant:
            use_batch_invariant_attention(model)  # before peft wraps it
        if config.float8:  # torchtitan's order: float8, then compile (in __init__), then fully_shard
            from ember.engine.float8 import convert

            convert(model, config.device, fsdp=parallelism is not None and parallelism.world_size > 1
                    and parallelism.fsdp)
        if lora_config is not None:
            model = add_lora_adapter(model, DEFAULT_ADAPTER, lora_config, unembed=head == "policy")
        parallel = None
        if parallelism is not None and config.activation_checkpointing:
            # under a mesh it must come before FSDP2 (torchtitan's order): let parallelize_model apply it
            parallelism = dataclasses.replace(parallelism, activation_checkpointing=True)
        if parallelism is not None and parallelism.cp > 1 and linear_attention_layers(model.config):
            # the delta-rule state would have to pass from one cp rank's columns to the next
            raise ValueError(f"ParallelismConfig.cp={parallelism.cp}: context parallelism splits a sequence over "
                             f"ranks, and {model.config.model_type}'s linear-attention layers carry a recurrent "
                             f"state along it that ember does not pass between ranks; use cp=1 for this family")
        if parallelism is not None and parallelism.world_size > 1 and vision_of(model.config) is not None:
            # FSDP2 gathers the tower's shards in its forward, which only ranks with images run
            raise UserError(f"{model.config.model_type} is a vision-language model; ember trains it on one rank "
                             f"(world_size 1), got a layout of {parallelism.world_size} ranks")
        if parallelism is not None and parallelism.ep > 1:  # before any rank builds a mesh
            from ember.engine.parallel import check_ep_model

            check_ep_model(model.config, parallelism.ep)
        if parallelism is not None and parallelism.world_size > 1:
            from ember.engine.parallel import ParallelContext, build_mesh, parallelize_model

            mesh = build_mesh(parallelism, torch.device(config.device).type)
            compute = resolve_dtype(config.autocast_dtype or config.dtype)
            parallelize_model(model, mesh, parallelism, compute)
            parallel = ParallelContext(parallelism, mesh)
        return cls(model, config, model_name=model_name or str(model_dir), lora_config=lora_config, parallel=parallel,
                   optimizer_config=optimizer_config, head=head)

    # ------------------------------------------------------------------ helpers
    def _load_vision(self, model) -> VisionSpec | None:
        """A vision-language model's image side, from the directory it was loaded from;
        refuses `train_vision` for a LoRA run (its tower is the base model's, shared)."""
        hf = hf_model(model)
        if vision_of(hf.config) is None:
            return None
        if self.config.train_vision and isinstance(model, PeftModel):
            raise UserError("train_vision trains the vision tower's own weights, which a LoRA run shares with the "
                             "other runs on its base model; train the tower in a full fine-tuning run")
        return load_vision_spec(hf.name_or_path, hf.config)

    def _rope_index(self):
        from ember.engine.vision_batch import model_rope_index

        return model_rope_index(hf_model(self.model)) if self.vision is not None else None

    def _frozen_tower(self) -> set[int]:
        """ids of the vision tower's parameters when they are not trained (`train_vision` off)."""
        if self.vision is None or self.config.train_vision:
            return set()
        tower = self.vision.family.tower
        return {id(p) for n, m in hf_model(self.model).named_modules() if n.rsplit(".", 1)[-1] == tower
                for p in m.parameters()}

    @property
    def is_lora(self) -> bool:
        return self.lora_config is not None

    @property
    def device(self) -> torch.device:
        return torch.device(self.config.device)

    @property
    def hf_config(self):
        return self.model.config

    @property
    def distributed(self) -> bool:
        return self.parallel is not None and self.parallel.is_distributed

    @property
    def _autocast(self) -> str | None:
        # Under FSDP2 on GPU the MixedPrecisionPolicy casts instead (see ember.engine.parallel).
        if self.distributed and self.parallel.config.fsdp and self.device.type == "cuda":
            return None
        return self.config.autocast_dtype

    @property
    def _packing(self) -> bool:
        """`EngineConfig.packing`, except for a model with linear-attention layers (Qwen3.5):
        transformers' torch kernels of the delta rule and its short convolution take no
        sequence boundaries, so a packed row would carry one sequence's state into the next;
        those run one sequence per row, right-padded (pads come after a sequence's tokens
        and the recurrence is causal, so they cannot change its outputs)."""
        return self.config.packing and not linear_attention_layers(self.hf_config)

    @property
    def _varlen_attention(self) -> bool:
        # flash-attention consumes packed position_ids as varlen sequences: one row, no T×T mask.
        return self.config.attn_implementation.startswith("flash_attention")

    @property
    def _packs_by_position(self) -> bool:
        family = family_of(self.hf_config)
        return family is None or family.packs_by_position

    @property
    def _pad_id(self) -> int:
        pad = getattr(self.hf_config.get_text_config(), "pad_token_id", None)
        return int(pad) if isinstance(pad, int) else 0

    def _activate(self) -> None:
        # Several tenants may share one PeftModel; make ours the active adapter.
        if self.is_lora and self.model.active_adapter != self.adapter_name:
            self.model.set_adapter(self.adapter_name)

    def _named_trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The model's trained parameters, then the head's (`head.` + its parameter name)."""
        head = [("head." + n, p) for n, p in self.head.named_parameters()]
        if not self.is_lora:
            unused = self._unused_output_embedding()
            frozen = self._frozen_tower()
            return [(n, p) for n, p in self.model.named_parameters() if p is not unused and id(p) not in frozen] + head
        tag_a, tag_b = f".lora_A.{self.adapter_name}.", f".lora_B.{self.adapter_name}."
        return [(n, p) for n, p in self.model.named_parameters() if tag_a in n or tag_b in n] + head

    def _unused_output_embedding(self) -> torch.nn.Parameter | None:
        """A value head's full-FT run leaves `lm_head` out (no gradient; not exported) —
        unless it is tied to the input embedding, which is trained."""
        if self.head.uses_lm_head:
            return None
        out, inp = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        if out is None or (inp is not None and out.weight is inp.weight):
            return None
        return out.weight

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        params = [p for _, p in self._named_trainable()]
        unused = None if self.is_lora else self._unused_output_embedding()
        if unused is not None:
            unused.requires_grad_(False)
        frozen = self._frozen_tower()  # a vision tower left as it is (empty for text models)
        for p in hf_model(self.model).parameters():
            if id(p) in frozen:
                p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        if not params:
            raise ValueError(f"model {self.model_name!r} has no trainable parameters")
        return params

    def _new_optimizer(self) -> Optimizer:
        return build_optimizer(self.optimizer_config, self._params, self.lora_config.rank if self.is_lora else None)

    # ------------------------------------------------------------------ float8
    def _check_float8(self) -> None:
        """`EngineConfig.float8` on a model given to the constructor: full fine-tuning only;
        a single-device model is converted here, a laid-out one must have been converted
        before `fully_shard` (`from_pretrained` does)."""
        from ember.engine import float8

        float8.check_lora(self.is_lora)
        if float8.is_converted(self.model):
            return
        if self.distributed:
            raise ValueError(f"{float8.SETTING}: the model must be converted before FSDP2's fully_shard "
                             "(TorchEngine.from_pretrained does it); this one was laid out without it")
        float8.convert(self.model, self.config.device, fsdp=False)

    @property
    def _float8_fsdp(self) -> bool:
        return self.config.float8 and self.distributed and self.parallel.config.fsdp

    # ------------------------------------------------------------------ compile
    def _compile(self):
        """`EngineConfig.compile` (`ember.engine.compile`): decoder layers, the policy head's
        chunks and (lazily) each loss compiled; a warm-up pass at start pays the compilation."""
        from ember.engine import compile as compiling

        layout = self.parallel.config if self.distributed else ParallelismConfig()
        compiling.check_compile_layout(layout.ep)
        stats = compiling.CompileStats(cache_dir=compiling.use_cache_dir(self.config.compile_cache_dir))
        compiling.compile_layers(decoder_layers(self.model), stats)
        if isinstance(self.head, PolicyHead):
            self.head.use_chunk_fn(compiling.on_a_copy(stats.compiled(unembed_target_logprobs)))
        compiling.timed(stats, self._warmup)
        return stats

    def _warmup(self) -> None:
        """Forward and backward passes that contribute nothing, on micro-batches of pad tokens
        laid out as requests are: one row, then rows of two lengths. Torch specialises a size
        of 1, so a one-row and a several-row micro-batch compile separately; both (and the
        head's chunks, as `_head_outputs` makes them) are compiled before the first request
        (under CP a compiled layer always gets a mask: `_cp_head_outputs`)."""
        self._activate()
        pad = self._pad_id
        for lengths in ((8,), (8, 5)):
            items = [PreparedDatum(i, torch.full((n,), pad, dtype=torch.int64),
                                   {"target_tokens": torch.full((n,), pad, dtype=torch.int64)})
                     for i, n in enumerate(lengths)]
            mb = build_micro_batch(items, self._packing, pad, single_row=self._varlen_attention)
            with torch.enable_grad():
                (self._head_outputs(mb).sum() * 0.0).backward()
        self.clear_gradients()

    def _loss_fn(self, spec):
        return self.compile_stats.compiled(spec.fn) if self.compile_stats is not None else spec.fn

    # ------------------------------------------------------------------ forward / backward
    def _head_outputs(self, mb: MicroBatch) -> torch.Tensor:
        """The head's per-token output for the real tokens of `mb`: log-probs or values (fp32)."""
        dev = self.device
        if self.distributed and self.parallel.cp > 1:
            return self._cp_head_outputs(mb)
        mask = None if mb.attention_mask is None else mb.attention_mask.to(dev)
        if mask is None and not self._packs_by_position:  # packed rows: their block-diagonal mask(s)
            mask = packed_masks(mb.position_ids.to(dev), resolve_dtype(self._autocast or self.config.dtype),
                                self.hf_config.get_text_config())
        out = self._model_forward(mb.input_ids.to(dev), mb.position_ids.to(dev), mask, mb.model_kwargs)
        return self.head.outputs(out, mb, dev)

    def _cp_head_outputs(self, mb: MicroBatch) -> torch.Tensor:
        """Context parallelism (`ember.engine.context_parallel`): this rank runs the model on its
        columns of `mb` (true positions, the full micro-batch's mask), scores its own real
        tokens, and all ranks exchange those outputs so each holds all T of them."""
        from ember.engine.context_parallel import gather_token_outputs, shard_micro_batch

        dev, rank, group = self.device, self.parallel.cp_rank(), self.parallel.cp_group()
        shard = shard_micro_batch(mb, self.parallel.cp, rank, self._pad_id, always_mask=self.config.compile)
        mask = None if shard.mask is None else shard.mask.to(dev)
        out = self._model_forward(shard.input_ids.to(dev), shard.position_ids.to(dev), mask)
        return gather_token_outputs(self.head.outputs(out, shard.local, dev), shard, group, rank)

    def _model_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                       images: dict[str, torch.Tensor] | None = None):
        """The HF model's output object (always the root module: FSDP2/TP/peft hooks stay in play).

        A chunked policy head asks for no logits (`logits_to_keep` empty; one position under
        a vocabulary-split TP lm_head, which cannot run on none); the decoder's last
        hidden state (after the final norm) is then read by a forward hook on the decoder
        — not `output_hidden_states`, which would keep every layer's output in a no-grad
        forward — and put on the output as `ember_last_hidden`. `images`: a vision-language
        micro-batch's pixels, grids and token types (`ember.engine.vision_batch`)."""
        amp = self._autocast
        kwargs = {k: v.to(self.device) if torch.is_tensor(v) else v
                  for k, v in {**self.head.model_kwargs, **(images or {})}.items()}
        captured: list[torch.Tensor] = []
        with self._capture_last_hidden(captured, "logits_to_keep" in kwargs and self.head.uses_lm_head), \
                self._activation_offload(), \
                torch.autocast(self.device.type, dtype=resolve_dtype(amp) if amp else None, enabled=amp is not None):
            out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False,
                             **kwargs)
        if captured:
            out.ember_last_hidden = captured[0]
        return out

    @contextlib.contextmanager
    def _capture_last_hidden(self, captured: list, wanted: bool):
        if not wanted:
            yield
            return
        decoder = hf_model(self.model).get_decoder()
        handle = decoder.register_forward_hook(lambda _m, _a, output: captured.append(output[0]))
        try:
            yield
        finally:
            handle.remove()

    def _activation_offload(self):
        """`EngineConfig.activation_offload`: tensors saved for backward live in (pinned) host memory."""
        if self.config.activation_offload and torch.is_grad_enabled():
            return torch.autograd.graph.save_on_cpu(pin_memory=True)
        return contextlib.nullcontext()

    def _unembed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's output-embedding module on `hidden` (peft's LoRA wrapper included), under
        the engine's autocast: the chunked policy head's LM head."""
        amp = self._autocast
        with torch.autocast(self.device.type, dtype=resolve_dtype(amp) if amp else None, enabled=amp is not None):
            return self.model.get_output_embeddings()(hidden)

    def _prepare(self, datums: Sequence[types.Datum], spec) -> tuple[list, list[list[int]], int]:
        """Validate and plan; under data parallelism all ranks agree on errors and pass count."""
        vocab = int(self.hf_config.get_text_config().vocab_size)
        if not self.distributed:
            prepared = prepare_datums(datums, spec, vocab, output=self.head.output, vision=self.vision)
            plan = plan_micro_batches([p.num_tokens for p in prepared], self.config.micro_batch_tokens)
            return prepared, plan, len(plan)
        error: ValueError | None = None
        prepared, plan = [], []
        try:  # a rank may get no datum at all (a batch smaller than the data-parallel degree)
            if self.head.output not in spec.consumes:  # the same refusal on a rank without datums
                raise UserError(head_mismatch(spec, self.head.output))
            prepared = prepare_datums(datums, spec, vocab, output=self.head.output,
                                      vision=self.vision) if len(datums) else []
            plan = plan_micro_batches([p.num_tokens for p in prepared], self.config.micro_batch_tokens)
        except ValueError as exc:
            error = exc
        failed, passes = self.parallel.max_over_ranks([int(error is not None), len(plan)])
        if error is not None:
            raise error
        if failed:
            raise UserError("another data-parallel rank rejected its share of the batch (see that rank's error)")
        if passes == 0:
            raise UserError("forward_backward needs at least one datum; got an empty list on every rank")
        return prepared, plan, passes

    def _padding_pass(self, backward: bool) -> None:
        """A forward(+backward) that contributes exactly zero: keeps FSDP/TP collectives in step."""
        ids = torch.full((1, 1), self._pad_id, dtype=torch.int64, device=self.device)
        with torch.set_grad_enabled(backward):
            out = self._model_forward(ids, torch.zeros_like(ids), None)
            if backward:
                self.head.zero_contribution(out).backward()

    def _run(self, datums: Sequence[types.Datum], loss_fn: str, loss_fn_config: LossConfig | None, backward: bool):
        spec = get_loss(loss_fn)
        cfg = resolve_config(loss_fn, loss_fn_config)
        datums, routes = split_routes(datums)
        prepared, plan, passes = self._prepare(datums, spec)
        routes = self._checked_routes(routes, prepared)
        self._activate()
        saved = self._stash_head_grads() if backward and self.distributed else None
        outputs: list[dict[str, types.TensorData]] = [None] * len(prepared)  # type: ignore[list-item]
        total = 0.0
        for _ in range(passes - len(plan)):
            self._padding_pass(backward)
        rope_index = self._rope_index()
        routing = self._routing.new_call(self.device) if self._routing is not None else None
        for group in plan:
            mb = build_micro_batch(
                [prepared[i] for i in group], self._packing, self._pad_id, single_row=self._varlen_attention,
                rope_index=rope_index,
            )
            with torch.set_grad_enabled(backward), self._replay(mb, [routes[i] for i in group]):
                with batch_invariant(self.config.batch_invariant):  # the forward only; backward as usual
                    logp, aux = self._outputs_and_aux(mb, routing)  # log-probs (or values), the MoE aux loss
                inputs = {k: v.to(logp.device) for k, v in mb.inputs.items()}
                elementwise = self._loss_fn(spec)(logp, inputs, cfg, mb.segment_ids.to(logp.device))
                loss = elementwise.sum()
                if backward:
                    (loss if aux is None else loss + aux).backward()
            total += float(loss.detach())
            self._scatter_outputs(mb, logp.detach(), elementwise.detach(), outputs)
            if backward:
                self._acc.accumulated_micro_batches += 1
                self._acc.accumulated_datums += len(group)
                self._acc.accumulated_tokens += mb.num_tokens
        if saved is not None:
            self._sum_head_grads_over_dp(saved)
        if routing is not None and self.distributed:
            routing.sum_over_ranks(self.parallel.sum_over_dp_)
        metrics = {"loss:sum": total} | (routing.metrics() if routing is not None else {})
        return types.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs, metrics=metrics)

    def _checked_routes(self, routes: list, prepared: list) -> list:
        """Routing replay's per-datum routes (`ember.engine.moe`), checked against the model;
        refused on a dense model and under context parallelism (whose ranks see no
        routers' flat token layout of the whole micro-batch)."""
        given = [i for i, r in enumerate(routes) if r is not None]
        if not given:
            return routes
        where = f"datum {given[0]}: loss_fn_inputs[{ROUTES_KEY!r}]"
        if self._routing is None:
            raise UserError(f"{where}: routing replay needs a mixture-of-experts model; this one is dense")
        if self.distributed and self.parallel.cp > 1:
            raise UserError(f"{where}: routing replay is not supported under context parallelism (cp > 1)")
        return self._routing.checked_routes(routes, [p.num_tokens for p in prepared])

    def _replay(self, mb: MicroBatch, routes: list):
        """The context that routes `mb`'s tokens through their recorded experts (a no-op without any)."""
        if self._routing is None:
            return contextlib.nullcontext()
        flat = flat_routes(routes, mb.lengths, mb.valid_index, mb.input_ids.numel(), self._routing.layers,
                           self._routing.top_k)
        return self._routing.replay(flat)

    def _outputs_and_aux(self, mb: MicroBatch,
                         routing: RoutingStats | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head's outputs for `mb`; for a mixture-of-experts model, its routing recorded
        in `routing` and the auxiliary load-balancing loss (None when off or dense)."""
        if routing is None or (self.distributed and self.parallel.cp > 1):
            return self._head_outputs(mb), None
        with self._routing.capture() as logits:
            out = self._head_outputs(mb)
        return out, self._routing.micro_batch(routing, logits, mb.valid_index, mb.segment_ids)

    def _stash_head_grads(self) -> list[torch.Tensor | None]:
        """Set the head's accumulated gradient aside, so only this call's part is reduced."""
        params = list(self.head.parameters())
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        return saved

    def _sum_head_grads_over_dp(self, saved: list[torch.Tensor | None]) -> None:
        """The head is replicated, not an FSDP unit: SUM this call's gradient over the
        data-parallel ranks (contract 2; TP ranks already hold the full gradient), then add
        back what was accumulated before."""
        params = list(self.head.parameters())
        fresh = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        self.parallel.sum_over_dp_(fresh)
        for p, g, old in zip(params, fresh, saved):
            p.grad = g if old is None else old + g

    @staticmethod
    def _scatter_outputs(mb: MicroBatch, logp: torch.Tensor, elementwise: torch.Tensor, outputs: list) -> None:
        logp_parts = torch.split(logp.float().cpu(), mb.lengths)
        loss_parts = torch.split(elementwise.float().cpu(), mb.lengths)
        for idx, lp, el in zip(mb.datum_indices, logp_parts, loss_parts):
            outputs[idx] = {
                "logprobs": types.TensorData.from_torch(lp.contiguous()),
                "elementwise_loss": types.TensorData.from_torch(el.contiguous()),
            }

    def forward_backward(self, datums, loss_fn, loss_fn_config=None) -> types.ForwardBackwardOutput:
        """Per-datum `logprobs` (the head's output: log-probs, or values for a value head)."""
        return self._run(datums, loss_fn, loss_fn_config, backward=True)

    def forward(self, datums, loss_fn, loss_fn_config=None) -> types.ForwardBackwardOutput:
        return self._run(datums, loss_fn, loss_fn_config, backward=False)

    # ------------------------------------------------------------------ optimizer
    def _grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        if self.distributed:  # per-shard norms reduced to the global norm; never gathers a gradient
            norms = torch.stack([_full_tensor(torch.linalg.vector_norm(g.float())).to(self.device) for g in grads])
        else:
            norms = torch.stack([torch.linalg.vector_norm(_full_tensor(g).float()) for g in grads])
        return torch.linalg.vector_norm(norms)

    def _clip(self, grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
        if not self.distributed:
            torch.nn.utils.clip_grad_norm_(self._params, max_norm)
            return
        # As torch.nn.utils.clip_grads_with_norm_, shard by shard (DTensors of different meshes).
        coef = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        for g in grads:
            g.mul_(coef)

    def _first_non_finite(self) -> str:
        for name, p in self._named_trainable():
            if p.grad is not None and not torch.isfinite(_full_tensor(p.grad)).all():
                return name
        return "?"

    def optim_step(self, adam_params: types.AdamParams | types.DimuonParams) -> dict[str, float]:
        """One update with the run's optimizer; `adam_params` must be its params type."""
        self.optimizer.check_type(adam_params)
        self.optimizer.validate(adam_params)
        self._activate()
        grads = [p.grad for p in self._params if p.grad is not None]
        norm_t = self._grad_norm(grads) if grads else torch.zeros(())
        norm = float(norm_t)
        if not math.isfinite(norm):
            bad = self._first_non_finite()
            self.clear_gradients()
            raise NonFiniteGradientError(
                f"optim_step refused a non-finite gradient (global norm {norm}; first bad parameter {bad!r}). "
                "Weights and optimizer state are unchanged; the accumulated gradient was discarded."
            )
        if grads and adam_params.grad_clip_norm > 0:
            self._clip(grads, adam_params.grad_clip_norm, norm_t)
        self._optimizer_step(adam_params)
        if self._float8_fsdp:
            from ember.engine.float8 import after_optim_step

            after_optim_step(self.model, fsdp=True)
        self._step += 1
        self.clear_gradients()
        return {"grad_norm:mean": norm, "learning_rate:mean": adam_params.learning_rate, "step:max": float(self._step)}

    def clear_gradients(self) -> None:
        self.optimizer.zero_grad(self._params)
        self._acc = EngineStatus(step=self._step, accumulated_micro_batches=0, accumulated_datums=0, accumulated_tokens=0)

    # ------------------------------------------------------------------ weights and state
    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Backbone (full FT) or adapter (LoRA) weights only; the head's are `head_weights`."""
        for name, t in self.named_weight_shards():
            t = _full_tensor(t).detach()
            yield name, t.to(dtype=dtype or t.dtype).clone()

    def named_weight_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """`named_weights` as this rank holds them, nothing gathered: DTensors under
        FSDP2/TP (plain tensors otherwise), the parameters themselves (not copies), which
        `named_weights` gathers."""
        if self.is_lora:
            items = get_peft_model_state_dict(self.model, adapter_name=self.adapter_name, save_embedding_layers=False).items()
        else:
            items = self.model.state_dict().items()
        for name, t in items:
            yield name, t.detach()

    def head_weights(self) -> dict[str, torch.Tensor]:
        """The head's tensors in transformers' names (`score.weight`, `score.bias`); {} for a policy."""
        return self.head.hf_state()

    def state_tensors(self) -> dict[str, torch.nn.Parameter]:
        """Trainable parameters keyed by a name independent of the adapter's name; the
        head's as `head.score.weight` / `head.score.bias`."""
        if not self.is_lora:
            return dict(self._named_trainable())
        tag = f".{self.adapter_name}."
        return {n if n.startswith("head.") else n.replace(tag, "."): p for n, p in self._named_trainable()}

    def save_state(self, path: str | os.PathLike, optimizer: bool = True) -> None:
        checkpoint.save(self, Path(path), optimizer=optimizer)

    def load_state(self, path: str | os.PathLike, optimizer: bool = True) -> None:
        self._activate()
        self.clear_gradients()
        checkpoint.load(self, Path(path), optimizer=optimizer)

    def export_hf(self, path: str | os.PathLike) -> None:
        checkpoint.export_hf(self, Path(path))

    def reset_optimizer(self, step: int = 0) -> None:
        self.optimizer = self._new_optimizer()
        self._step = step
        self.clear_gradients()

    def info(self) -> EngineInfo:
        n_all = sum(p.numel() for p in self.model.parameters()) + sum(p.numel() for p in self.head.parameters())
        return EngineInfo(
            model_name=self.model_name,
            model_type=str(self.hf_config.model_type),
            is_lora=self.is_lora,
            lora_rank=self.lora_config.rank if self.is_lora else None,
            lora_config=self.lora_config.model_dump() if self.is_lora else None,
            parallel=self.parallel.info() if self.parallel else ParallelismConfig().as_dict(),
            device=self.config.device,
            dtype=self.config.dtype,
            num_parameters=n_all,
            num_trainable_parameters=sum(p.numel() for p in self._params),
            packing="packed" if self._packing else "padded",
            head=self.head.name,
            extra={"compile": self.compile_stats.as_dict()} if self.compile_stats is not None else {},
        )

    def status(self) -> EngineStatus:
        self._acc.step = self._step
        return EngineStatus(**vars(self._acc))

    @property
    def step(self) -> int:
        return self._step

    # ------------------------------------------------------------------ colocation
    def _move(self, device: torch.device) -> None:
        if not self.is_lora or self.distributed:
            # FSDP2's `_apply` re-registers its sharded parameters; assigning p.data would not.
            self.model.to(device)
            self.head.to(device)
        for p in self._params:
            p.data = p.data.to(device)
            if p.grad is not None:
                p.grad = p.grad.to(device)
        self._place_optimizer_state(device)

    def _place_optimizer_state(self, device: torch.device) -> None:
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if torch.is_tensor(v) and k != "step":
                    state[k] = v.to(device)

    def _optimizer_step(self, params: types.AdamParams | types.DimuonParams) -> None:
        """The update; with `EngineConfig.optimizer_offload` the state comes to the device for
        it and goes back to host memory afterwards (it is created on the device at the first step)."""
        if not self.config.optimizer_offload:
            self.optimizer.step(params)
            return
        self._place_optimizer_state(self.device)
        self.optimizer.step(params)
        self._place_optimizer_state(torch.device("cpu"))

    def offload(self) -> None:
        from ember.workers.memory import release_cached_memory

        self._move(torch.device("cpu"))
        release_cached_memory(self.device)  # reserved, not only allocated, memory goes back

    def onload(self) -> None:
        self._move(self.device)
