"""`TorchEngine`: a Hugging Face causal LM (full fine-tuning or a LoRA adapter) + its optimizer
(AdamW by default, or Dimuon: `ember.engine.optimizers`).

Exactness is the point (DESIGN.md contract 2): a `forward_backward` adds
∇ Σ_datums loss(datum) to the parameters' `.grad`, micro-batch by micro-batch, with no
scaling, so any micro-batch budget, packing or split over calls gives the same gradient.
The model always runs in eval mode (no dropout), like Tinker, so `forward`,
`forward_backward` and the sampler see the same function.
"""
# ember: single-process engine complete

from __future__ import annotations

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
from ember.engine.batching import MicroBatch, build_micro_batch, plan_micro_batches, prepare_datums
from ember.engine.config import EngineConfig
from ember.engine.optimizers import Optimizer, build_optimizer
from ember.losses import get_loss, resolve_config
from ember.models import add_lora_adapter, load_model, resolve_dtype

if TYPE_CHECKING:
    from ember.engine.parallel import ParallelContext, ParallelismConfig

DEFAULT_ADAPTER = "default"


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    # DTensor (FSDP2/TP) → gather the full tensor; plain tensors pass through.
    return t.full_tensor() if hasattr(t, "full_tensor") else t


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
    ) -> None:
        self.config = config or EngineConfig()
        self.parallel = parallel
        self.model = model
        self.model_name = model_name
        self.lora_config = lora_config
        self.adapter_name = adapter_name if lora_config is not None else None
        if lora_config is not None and not isinstance(model, PeftModel):
            raise TypeError("a LoRA TorchEngine needs a PeftModel carrying its adapter (see ember.models.add_lora_adapter)")
        self.model.eval()  # no dropout: trainer, forward and sampler compute the same function
        self._activate()
        self._params = self._trainable_parameters()
        self.optimizer_config = optimizer_config
        self.optimizer = self._new_optimizer()
        self._step = 0
        self._acc = EngineStatus(step=0, accumulated_micro_batches=0, accumulated_datums=0, accumulated_tokens=0)

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | os.PathLike,
        config: EngineConfig | None = None,
        lora_config: types.LoraConfig | None = None,
        model_name: str | None = None,
        parallelism: "ParallelismConfig | None" = None,
        optimizer_config: types.OptimizerConfig | dict | None = None,
    ) -> "TorchEngine":
        """Load a local HF checkpoint; wrap it with a fresh LoRA adapter when `lora_config` is given.

        With `parallelism` (world size > 1, torch.distributed initialised — see
        `ember.workers`), build the DeviceMesh and lay the model out on it.
        """
        config = config or EngineConfig()
        model = load_model(model_dir, config.dtype, config.device, config.attn_implementation)
        if lora_config is not None:
            model = add_lora_adapter(model, DEFAULT_ADAPTER, lora_config)
        parallel = None
        if parallelism is not None and parallelism.world_size > 1:
            from ember.engine.parallel import ParallelContext, build_mesh, parallelize_model

            mesh = build_mesh(parallelism, torch.device(config.device).type)
            compute = resolve_dtype(config.autocast_dtype or config.dtype)
            parallelize_model(model, mesh, parallelism, compute)
            parallel = ParallelContext(parallelism, mesh)
        return cls(model, config, model_name=model_name or str(model_dir), lora_config=lora_config, parallel=parallel,
                   optimizer_config=optimizer_config)

    # ------------------------------------------------------------------ helpers
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
        if self.distributed and self.parallel.config.dp_size > 1 and self.device.type == "cuda":
            return None
        return self.config.autocast_dtype

    @property
    def _varlen_attention(self) -> bool:
        # flash-attention consumes packed position_ids as varlen sequences: one row, no T×T mask.
        return self.config.attn_implementation.startswith("flash_attention")

    @property
    def _pad_id(self) -> int:
        pad = getattr(self.hf_config, "pad_token_id", None)
        return int(pad) if isinstance(pad, int) else 0

    def _activate(self) -> None:
        # Several tenants may share one PeftModel; make ours the active adapter.
        if self.is_lora and self.model.active_adapter != self.adapter_name:
            self.model.set_adapter(self.adapter_name)

    def _named_trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        if not self.is_lora:
            return list(self.model.named_parameters())
        tag_a, tag_b = f".lora_A.{self.adapter_name}.", f".lora_B.{self.adapter_name}."
        return [(n, p) for n, p in self.model.named_parameters() if tag_a in n or tag_b in n]

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        params = [p for _, p in self._named_trainable()]
        for p in params:
            p.requires_grad_(True)
        if not params:
            raise ValueError(f"model {self.model_name!r} has no trainable parameters")
        return params

    def _new_optimizer(self) -> Optimizer:
        return build_optimizer(self.optimizer_config, self._params, self.lora_config.rank if self.is_lora else None)

    # ------------------------------------------------------------------ forward / backward
    def _target_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        dev = self.device
        mask = None if mb.attention_mask is None else mb.attention_mask.to(dev)
        logits = self._logits(mb.input_ids.to(dev), mb.position_ids.to(dev), mask)
        logits = logits.flatten(0, 1).index_select(0, mb.valid_index.to(dev))  # (T, V)
        logp = torch.log_softmax(logits.float(), dim=-1)  # fp32 even for bf16 models
        targets = mb.inputs["target_tokens"].to(dev)
        if targets.dim() == 1:
            return logp.gather(1, targets.unsqueeze(1)).squeeze(1)
        return logp.gather(1, targets)

    def _logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        amp = self._autocast
        with torch.autocast(self.device.type, dtype=resolve_dtype(amp) if amp else None, enabled=amp is not None):
            out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False)
        return out.logits

    def _prepare(self, datums: Sequence[types.Datum], spec) -> tuple[list, list[list[int]], int]:
        """Validate and plan; under data parallelism all ranks agree on errors and pass count."""
        vocab = int(self.hf_config.vocab_size)
        if not self.distributed:
            prepared = prepare_datums(datums, spec, vocab)
            plan = plan_micro_batches([p.num_tokens for p in prepared], self.config.micro_batch_tokens)
            return prepared, plan, len(plan)
        error: ValueError | None = None
        prepared, plan = [], []
        try:  # a rank may get no datum at all (a batch smaller than the data-parallel degree)
            prepared = prepare_datums(datums, spec, vocab) if len(datums) else []
            plan = plan_micro_batches([p.num_tokens for p in prepared], self.config.micro_batch_tokens)
        except ValueError as exc:
            error = exc
        failed, passes = self.parallel.max_over_ranks([int(error is not None), len(plan)])
        if error is not None:
            raise error
        if failed:
            raise ValueError("another data-parallel rank rejected its share of the batch (see that rank's error)")
        if passes == 0:
            raise ValueError("forward_backward needs at least one datum; got an empty list on every rank")
        return prepared, plan, passes

    def _padding_pass(self, backward: bool) -> None:
        """A forward(+backward) that contributes exactly zero: keeps FSDP/TP collectives in step."""
        ids = torch.full((1, 1), self._pad_id, dtype=torch.int64, device=self.device)
        with torch.set_grad_enabled(backward):
            logits = self._logits(ids, torch.zeros_like(ids), None)
            if backward:
                (logits.float().sum() * 0.0).backward()

    def _run(self, datums: Sequence[types.Datum], loss_fn: str, loss_fn_config: LossConfig | None, backward: bool):
        spec = get_loss(loss_fn)
        cfg = resolve_config(loss_fn, loss_fn_config)
        prepared, plan, passes = self._prepare(datums, spec)
        self._activate()
        outputs: list[dict[str, types.TensorData]] = [None] * len(prepared)  # type: ignore[list-item]
        total = 0.0
        for _ in range(passes - len(plan)):
            self._padding_pass(backward)
        for group in plan:
            mb = build_micro_batch(
                [prepared[i] for i in group], self.config.packing, self._pad_id, single_row=self._varlen_attention
            )
            with torch.set_grad_enabled(backward):
                logp = self._target_logprobs(mb)
                inputs = {k: v.to(logp.device) for k, v in mb.inputs.items()}
                elementwise = spec.fn(logp, inputs, cfg, mb.segment_ids.to(logp.device))
                loss = elementwise.sum()
                if backward:
                    loss.backward()
            total += float(loss.detach())
            self._scatter_outputs(mb, logp.detach(), elementwise.detach(), outputs)
            if backward:
                self._acc.accumulated_micro_batches += 1
                self._acc.accumulated_datums += len(group)
                self._acc.accumulated_tokens += mb.num_tokens
        return types.ForwardBackwardOutput(
            loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs, metrics={"loss:sum": total}
        )

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
        self.optimizer.step(adam_params)
        self._step += 1
        self.clear_gradients()
        return {"grad_norm:mean": norm, "learning_rate:mean": adam_params.learning_rate, "step:max": float(self._step)}

    def clear_gradients(self) -> None:
        self.optimizer.zero_grad(self._params)
        self._acc = EngineStatus(step=self._step, accumulated_micro_batches=0, accumulated_datums=0, accumulated_tokens=0)

    # ------------------------------------------------------------------ weights and state
    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        if self.is_lora:
            items = get_peft_model_state_dict(self.model, adapter_name=self.adapter_name, save_embedding_layers=False).items()
        else:
            items = self.model.state_dict().items()
        for name, t in items:
            t = _full_tensor(t).detach()
            yield name, t.to(dtype=dtype or t.dtype).clone()

    def state_tensors(self) -> dict[str, torch.nn.Parameter]:
        """Trainable parameters keyed by a name independent of the adapter's name."""
        if not self.is_lora:
            return dict(self._named_trainable())
        return {n.replace(f".{self.adapter_name}.", "."): p for n, p in self._named_trainable()}

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
        n_all = sum(p.numel() for p in self.model.parameters())
        return EngineInfo(
            model_name=self.model_name,
            model_type=str(self.hf_config.model_type),
            is_lora=self.is_lora,
            lora_rank=self.lora_config.rank if self.is_lora else None,
            lora_config=self.lora_config.model_dump() if self.is_lora else None,
            parallel=self.parallel.info() if self.parallel else {"world_size": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1},
            device=self.config.device,
            dtype=self.config.dtype,
            num_parameters=n_all,
            num_trainable_parameters=sum(p.numel() for p in self._params),
            packing="packed" if self.config.packing else "padded",
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
        for p in self._params:
            p.data = p.data.to(device)
            if p.grad is not None:
                p.grad = p.grad.to(device)
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if torch.is_tensor(v) and k != "step":
                    state[k] = v.to(device)

    def offload(self) -> None:
        self._move(torch.device("cpu"))

    def onload(self) -> None:
        self._move(self.device)
