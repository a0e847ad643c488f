"""Parallel layouts for a Hugging Face causal LM on a DeviceMesh: FSDP2, HSDP/replication, TP.

Mesh: four named dims, outermost first, `("dp_replicate", "dp_shard", "cp", "tp")`, so
the ranks of one tensor-parallel group are contiguous and the data-parallel rank of global
rank r is `r // (cp * tp)` (`ParallelismConfig.dp_rank`). Every data-parallel rank receives
its own datums; the `cp * tp` ranks of one data-parallel rank receive the same datums.

Order of application (as torchtitan): tensor parallel → context parallel → activation
checkpointing → FSDP2.

* **CP** (`cp > 1`, `ember.engine.context_parallel`): each micro-batch's columns are split
  over the cp ranks; attention is DeepSpeed-Ulysses (all-to-all over heads), installed
  through transformers' `AttentionInterface`. FSDP2 then shards over the flattened
  `(dp_shard, cp)` dims (`dp_shard_cp`, as torchtitan), which SUMs the cp ranks' gradients.
  With TP too, the all-to-all runs among the cp ranks of one TP index and splits that TP
  rank's heads, so `cp * tp` must divide the attention heads.

* **TP** (`tp > 1`, the families of `ember.models.families` with a `tp_plan`): DTensor `parallelize_module` per decoder layer —
  `ColwiseParallel` for q/k/v/gate/up, `RowwiseParallel` for o/down. The attention modules
  of these families read head counts only through `view(..., -1, head_dim)` and the
  ratio `num_key_value_groups` (unchanged by TP), so nothing in the model needs to be
  rewritten; `check_tp_divisibility` makes sure every rank holds whole heads. Qwen3's
  per-head `q_norm`/`k_norm` see only the local heads, so their weights become replicated
  DTensors (`SequenceParallel` over the heads dim) whose gradient DTensor sums across TP
  ranks. An untied `lm_head` is split by vocabulary rows (`ColwiseParallel`: each rank
  holds ceil(V / tp) rows, torch.chunk's split, so the last shard is the short one when
  `tp` does not divide V; a split that would leave a rank empty is refused): its logits
  are the rank's vocabulary slice, and the policy head computes the log-softmax across
  the TP ranks without gathering the vocabulary (`ember.engine.vocab_parallel`). Its
  weight is a `Shard(0)` DTensor, so checkpoints (DCP), `named_weights`, HF export and
  the sampler's weights see the full matrix as for every other TP tensor. A tied
  `lm_head` (`tie_word_embeddings`: it IS the input embedding) stays replicated: splitting
  it would also need a vocabulary-parallel embedding lookup (masked, then all-reduced) and
  two parallel styles on one Parameter; tied models are the small ones, where the
  vocabulary matrix is a small share of the memory. Embeddings and layer norms stay
  replicated plain tensors: they see the full (all-reduced) activations, so every TP rank
  computes their complete gradient.
  LoRA layers (peft) are split too: the base Linear as above, `lora_B` column-wise after a
  replicated `lora_A` (q/k/v/gate/up), `lora_A` row-wise before a replicated `lora_B`
  (o/down).
* **FSDP2** (`dp_shard > 1` or `dp_replicate > 1`): `fully_shard` per decoder layer and at
  the root, on the 1-D `dp_shard` mesh, or the 2-D `(dp_replicate, dp_shard)` mesh (HSDP;
  with `dp_shard == 1` that is DDP-style replication). **Gradient reduction is a SUM**
  (docs/architecture.md contract 2): FSDP2 averages by default, so every FSDP module gets
  `set_gradient_divide_factor(1.0)` and `set_force_sum_reduction_for_comms(True)` (in
  torch 2.13, `_fsdp_collectives._get_gradient_divide_factors` then picks
  `ReduceOp.SUM` for both the reduce-scatter and the HSDP all-reduce and a post-divide
  factor of 1, i.e. none; gloo has no PREMUL_SUM, so the force-sum flag is needed on CPU).
* **EP** (`ep > 1`, mixture-of-experts models, `ember.engine.expert_parallel`): taken from
  the ranks of dp_shard (torchtitan's layout; needs tp == cp == 1). Applied before FSDP2:
  each experts module's tensors become DTensors split by expert over runs of `ep`
  consecutive ranks (mesh `(ep_replicate, ep)`), with their forward (all-to-all dispatch)
  registered in transformers' `ExpertsInterface`; FSDP2 then leaves them out
  (`ignored_params`) and shards the rest over dp_shard as usual.
* **Mixed precision**: with a bf16 compute dtype on GPU, `MixedPrecisionPolicy(param_dtype=
  bf16, reduce_dtype=fp32)`; the sharded parameters (and AdamW state) stay in the dtype the
  model was loaded in. On CPU/fp32 no policy (exactness tests run there).
* **CPU offload** (`cpu_offload=True`, GPU only): FSDP2's `CPUOffloadPolicy`.
* **Activation checkpointing**: `torch.distributed._composable.checkpoint` on each decoder
  layer — a composable API (hooks, no wrapper module), so parameter names, state dicts and
  checkpoints are unchanged. transformers' own `gradient_checkpointing_enable` only acts in
  training mode and ember's engine runs in eval mode (no dropout).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ember.models.families import LLAMA_TP_PLAN, TensorParallelPlan, family_of, moe_of, tp_families

if TYPE_CHECKING:
    from ember.engine.vocab_parallel import VocabShard

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class ParallelismConfig:
    """How one engine is laid out over `world_size = dp_replicate * dp_shard * cp * tp` ranks.

    dp_replicate: replicas holding a full copy each (HSDP across replicas; DDP-style when
        dp_shard == 1). Gradients are summed across replicas.
    dp_shard: FSDP2 degree: parameters, gradients and optimizer state are sharded dim-0.
    tp: tensor-parallel degree (Llama/Qwen3 attention heads and MLP columns).
    cp: context-parallel degree: each sequence's tokens are split over `cp` ranks (Ulysses
        attention, `ember.engine.context_parallel`); must divide the attention heads each
        TP rank holds (`num_attention_heads / tp`).
        Activations per rank shrink `cp` times; parameters are sharded over dp_shard * cp.
    activation_checkpointing: recompute each decoder layer's activations in backward.
    cpu_offload: FSDP2 CPUOffloadPolicy (sharded params/grads/optimizer on CPU; GPU only).
    ep: expert-parallel degree of a mixture-of-experts model, taken from the ranks of
        dp_shard (torchtitan's layout; it adds no ranks): each MoE layer's experts are split
        over `ep` consecutive ranks, which exchange tokens with all-to-all
        (`ember.engine.expert_parallel`). Must divide dp_shard; needs tp == cp == 1. A
        dense model ignores it (its ep ranks are plain dp_shard ranks).
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    activation_checkpointing: bool = False
    cp: int = 1
    cpu_offload: bool = False
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "cp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelismConfig.{name} must be an integer >= 1, got {value!r}")
        if self.cpu_offload and not self.fsdp:
            raise ValueError("ParallelismConfig.cpu_offload needs FSDP2 (dp_shard or dp_replicate > 1)")
        if self.ep > 1 and self.dp_shard % self.ep:
            raise ValueError(f"ParallelismConfig.ep={self.ep} must divide dp_shard={self.dp_shard} "
                             "(expert parallelism takes its ranks from dp_shard)")
        if self.ep > 1 and (self.tp > 1 or self.cp > 1):
            raise ValueError(f"ParallelismConfig.ep={self.ep} needs tp=1 and cp=1, got tp={self.tp}, cp={self.cp}")

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 wraps the model (data parallelism or context parallelism)."""
        return self.dp_size * self.cp > 1

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks (each gets its own share of the datums)."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """Data-parallel rank of global rank `rank` (cp, then tp, are the innermost mesh dims)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of size {self.world_size}")
        return rank // (self.cp * self.tp)

    def as_dict(self) -> dict[str, int]:
        out = {"world_size": self.world_size, "dp_replicate": self.dp_replicate,
               "dp_shard": self.dp_shard, "tp": self.tp}
        if self.cp > 1:  # listed only when used: layouts without CP read as before
            out["cp"] = self.cp
        if self.ep > 1:
            out["ep"] = self.ep
        return out

    @classmethod
    def for_world(cls, world_size: int, **kwargs) -> "ParallelismConfig":
        """Default layout for `world_size` ranks: FSDP2 over all of them."""
        return cls(dp_shard=world_size, **kwargs)


def build_mesh(pconfig: ParallelismConfig, device_type: str = "cpu") -> DeviceMesh:
    """A DeviceMesh of shape (dp_replicate, dp_shard, cp, tp) with those dim names.

    The default process group must be initialised with exactly `pconfig.world_size` ranks.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("build_mesh needs torch.distributed initialised (use ember.workers to start ranks)")
    world = dist.get_world_size()
    if world != pconfig.world_size:
        raise ValueError(
            f"ParallelismConfig {pconfig.as_dict()} needs {pconfig.world_size} ranks; the process group has {world}"
        )
    shape = (pconfig.dp_replicate, pconfig.dp_shard, pconfig.cp, pconfig.tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)


# ---------------------------------------------------------------------- model structure
def hf_model(model: nn.Module) -> nn.Module:
    """The transformers `*ForCausalLM` inside a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """`model.model.layers` of a Llama/Qwen-style causal LM (peft-wrapped or not)."""
    inner = getattr(hf_model(model), "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(hf_model(model)).__name__} has no `model.layers`; cannot parallelize it per layer")
    return layers


def mixed_precision_policy(device_type: str, dtype: torch.dtype):
    """FSDP2's casting for compute dtype `dtype`: on CUDA a half-precision compute dtype (bf16
    or fp16: `EngineConfig.autocast_dtype`, which the engine does not apply itself under
    FSDP2 on GPU) gathers parameters in it and reduces gradients in fp32; otherwise none."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if device_type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


# ---------------------------------------------------------------------- tensor parallel
def check_tp_divisibility(config, tp: int) -> None:
    """Refuse (ValueError naming the size) a model whose family has no TP plan or whose heads
    or MLP width do not divide by `tp`: every rank must hold whole heads."""
    family = family_of(config)
    if family is None or family.tp_plan is None:
        model_type = str(getattr(config, "model_type", "?"))
        raise ValueError(f"tensor parallelism supports {tp_families()}; this model is {model_type!r}")
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
    }
    for name, value in sizes.items():
        if value % tp:
            raise ValueError(f"tp={tp} must divide config.{name}={value} (each rank holds whole heads/columns)")


def _lora_leaves(module: nn.Module) -> tuple[nn.Module, list[str]] | None:
    """(base Linear, adapter names) of a peft LoRA layer; None for a plain Linear."""
    base = getattr(module, "base_layer", None)
    if base is None:
        return None
    return base, list(getattr(module, "lora_A", {}).keys())


@functools.cache
def _flat_styles() -> tuple[type, type]:
    """Colwise/RowwiseParallel whose Linear multiplies a 2-D (B·T, in) DTensor: a forward
    pre-hook flattens the input's leading dims, a forward hook restores them on the (local)
    output. The values are those of the 3-D product (matmul flattens the same way). Why:
    under `torch.compile` with dynamic shapes, tracing the backward of a DTensor matmul on a
    3-D input (its `_unsafe_view` with symbolic sizes) recurses without end in torch 2.13;
    on 2-D inputs it traces (docs/architecture.md#compile)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    class _Flat:
        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            out = super()._apply(module, device_mesh)
            leads: list = []  # set by the pre-hook, popped by the hook (a call that raised left one)

            def flatten(_mod, args):
                leads.clear()
                leads.append(args[0].shape[:-1])
                return (args[0].flatten(0, -2), *args[1:])

            def restore(_mod, _args, output):
                return output.unflatten(0, leads.pop())

            module.register_forward_pre_hook(flatten, prepend=True)
            module.register_forward_hook(restore)
            return out

    class FlatColwise(_Flat, ColwiseParallel):
        pass

    class FlatRowwise(_Flat, RowwiseParallel):
        pass

    return FlatColwise, FlatRowwise


def _projection_plan(layer: nn.Module, path: str, rowwise: bool) -> dict:
    colwise, rowwise_style = _flat_styles()
    style = rowwise_style if rowwise else colwise
    lora = _lora_leaves(layer.get_submodule(path))
    if lora is None:
        return {path: style()}
    # Column split: x → A (replicated) → B (columns split). Row split: x_shard → A (rows split) → B (replicated).
    plan = {f"{path}.base_layer": style()}
    for name in lora[1]:
        plan[f"{path}.lora_A.{name}" if rowwise else f"{path}.lora_B.{name}"] = style()
    return plan


def layer_tp_plan(layer: nn.Module, family_plan: TensorParallelPlan = LLAMA_TP_PLAN) -> dict:
    """The `parallelize_module` plan of one decoder layer (`ember.models.families` says how
    each family's layer is split)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    plan: dict = {}
    for path in family_plan.colwise:
        plan.update(_projection_plan(layer, path, rowwise=False))
    for path in family_plan.rowwise:
        plan.update(_projection_plan(layer, path, rowwise=True))
    for path in family_plan.head_norms:
        try:
            layer.get_submodule(path)
        except AttributeError:
            continue
        # (B, L, heads, head_dim): the local heads are a Shard(2) of all heads.
        plan[path] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def shards_vocab(model: nn.Module, tp: int) -> bool:
    """Whether tensor parallelism over `tp` ranks splits `model`'s lm_head by vocabulary rows:
    an untied output embedding (a tied one stays replicated: see the module docstring).
    ValueError when the split would leave a rank without rows."""
    from ember.engine.vocab_parallel import check_vocab_split

    hf = hf_model(model)
    out, inp = hf.get_output_embeddings(), hf.get_input_embeddings()
    if tp < 2 or out is None or (inp is not None and out.weight is inp.weight):
        return False
    check_vocab_split(int(out.weight.shape[0]), tp)
    return True


def _lm_head_path(hf: nn.Module) -> str:
    out = hf.get_output_embeddings()
    return next(name for name, m in hf.named_modules() if m is out)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    config = hf_model(model).config
    check_tp_divisibility(config, tp_mesh.size())
    family_plan = family_of(config).tp_plan
    vocab_split = shards_vocab(model, tp_mesh.size())
    # parallelize_module re-registers parameters; keep frozen ones frozen (LoRA base weights).
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    for layer in decoder_layers(model):
        parallelize_module(layer, tp_mesh, layer_tp_plan(layer, family_plan))
    if vocab_split:  # rows of lm_head (and of a LoRA B on it; A replicated), local logits out
        hf = hf_model(model)
        parallelize_module(hf, tp_mesh, _projection_plan(hf, _lm_head_path(hf), rowwise=False))
    for n, p in model.named_parameters():
        if n in frozen:
            p.requires_grad_(False)


# ---------------------------------------------------------------------- FSDP2
def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def set_sum_reduction(modules: Iterable[nn.Module]) -> None:
    """Make FSDP2 SUM gradients across data-parallel ranks instead of averaging them."""
    for m in modules:
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, dtype: torch.dtype, cpu_offload: bool,
               ignored: set[nn.Parameter] | None = None) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    device_type = dp_mesh.device_type
    if cpu_offload and device_type == "cpu":
        raise ValueError("ParallelismConfig.cpu_offload needs a CUDA device; the model is already on the CPU")
    kwargs = {
        "mesh": dp_mesh,
        "mp_policy": mixed_precision_policy(device_type, dtype),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
        "ignored_params": ignored or None,  # expert-parallel weights: already split over ep
    }
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    set_sum_reduction(fsdp_modules(model))


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Composable checkpoint on every decoder layer; layers that already have it are left
    as they are (a LoRA base shared by several engines, or one laid out on a mesh)."""
    from torch.distributed._composable import checkpoint
    from torch.distributed._composable.contract import _get_registry

    for layer in decoder_layers(model):
        if "checkpoint" not in (_get_registry(layer) or {}):
            checkpoint(layer)


def parallelize_model(
    model: nn.Module, mesh: DeviceMesh | None, pconfig: ParallelismConfig, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """Apply TP, activation checkpointing and FSDP2 in place (see the module docstring).

    `dtype` is the compute dtype (bf16 on GPU turns on FSDP2 mixed precision). With a
    world of one and no activation checkpointing the model is returned untouched.
    """
    if pconfig.world_size > 1:
        if mesh is None:
            raise ValueError(f"ParallelismConfig {pconfig.as_dict()} needs a DeviceMesh (see build_mesh)")
        if tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
            raise ValueError(f"mesh dims must be {MESH_DIMS}, got {mesh.mesh_dim_names}")
    if pconfig.tp > 1:
        apply_tp(model, mesh["tp"])
    if pconfig.cp > 1:
        apply_cp(model, mesh["cp"], pconfig.tp)
    ignored = apply_ep(model, pconfig, mesh.device_type) if check_ep_model(hf_model(model).config, pconfig.ep) \
        else None
    if pconfig.activation_checkpointing:
        apply_activation_checkpointing(model)
    if pconfig.fsdp:
        apply_fsdp(model, fsdp_mesh(mesh, pconfig), dtype, pconfig.cpu_offload, ignored)
    return model


def check_ep_model(config, ep: int) -> bool:
    """Whether `ep` splits the experts of the model of transformers `config`: False for a
    dense model (its ep ranks are plain dp_shard ranks, so one `--parallel.ep` serves dense
    and MoE models alike); ValueError naming both numbers when `ep` does not divide the
    experts per layer."""
    from ember.engine.expert_parallel import check_ep

    layout = moe_of(config)
    if layout is None or ep == 1:
        return False
    check_ep(int(getattr(config, layout.num_experts)), ep)
    return True


def ep_mesh(pconfig: ParallelismConfig, device_type: str) -> DeviceMesh:
    """The expert weights' (ep_replicate, ep) mesh: ep groups are consecutive ranks (with
    tp == cp == 1, rank = replica * dp_shard + shard index, and ep divides dp_shard)."""
    from ember.engine.expert_parallel import EP_MESH_DIMS

    return init_device_mesh(device_type, (pconfig.world_size // pconfig.ep, pconfig.ep), mesh_dim_names=EP_MESH_DIMS)


def apply_ep(model: nn.Module, pconfig: ParallelismConfig, device_type: str) -> set[nn.Parameter]:
    """Split the experts over `pconfig.ep` ranks and install the all-to-all dispatch
    (`ember.engine.expert_parallel`); returns the expert parameters, which FSDP2 leaves out."""
    from ember.engine.expert_parallel import ExpertShard, install_experts, shard_experts

    hf = hf_model(model)
    layout = moe_of(hf.config)
    mesh = ep_mesh(pconfig, device_type)
    replicas = mesh["ep_replicate"].get_group() if mesh["ep_replicate"].size() > 1 else None
    shard = ExpertShard(mesh["ep"].get_group(), pconfig.ep, int(getattr(hf.config, layout.num_experts)), replicas)
    params = shard_experts(model, layout.experts, mesh)
    install_experts(hf, shard)
    return params


def fsdp_mesh(mesh: DeviceMesh, pconfig: ParallelismConfig) -> DeviceMesh:
    """FSDP2's mesh: `dp_shard` (× `cp`, flattened to `dp_shard_cp`), with `dp_replicate` outside for HSDP."""
    shard = "dp_shard"
    if pconfig.cp > 1:
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        shard = "dp_shard_cp"
    return mesh[shard] if pconfig.dp_replicate == 1 else mesh["dp_replicate", shard]


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, tp: int = 1) -> None:
    """Ulysses attention over `cp_mesh`'s group (see `ember.engine.context_parallel`); `tp`:
    the tensor-parallel degree the model's heads are already split by."""
    from ember.engine.context_parallel import install_attention

    check_cp_heads(hf_model(model).config, cp_mesh.size(), tp=tp)
    install_attention(hf_model(model), cp_mesh.get_group(), cp_mesh.size())


def check_cp_heads(config, cp: int, key: str = "cp", tp: int = 1) -> None:
    """ValueError unless `cp` divides the attention heads each of `tp` tensor-parallel ranks
    holds in the transformers `config` (Ulysses attention gives each rank whole heads);
    `key` names the setting in the message."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    if heads % cp and tp == 1:
        raise ValueError(f"{key}={cp} must divide config.num_attention_heads={heads} "
                         "(Ulysses attention gives each rank whole heads)")
    if heads % (cp * tp):
        raise ValueError(f"{key}={cp} must divide the attention heads of each tp={tp} rank "
                         f"(config.num_attention_heads={heads} / {tp}; Ulysses attention gives each rank whole heads)")


# ---------------------------------------------------------------------- runtime helpers for engines
@dataclass
class ParallelContext:
    """What a parallel engine needs at run time: its layout and mesh."""

    config: ParallelismConfig
    mesh: DeviceMesh | None = None

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def is_distributed(self) -> bool:
        return self.config.world_size > 1

    def info(self) -> dict[str, int]:
        return self.config.as_dict()

    def max_over_ranks(self, values: list[int]) -> list[int]:
        """Element-wise MAX of small integer vectors over all ranks (one all-reduce)."""
        if not self.is_distributed:
            return list(values)
        device = "cpu" if self.mesh is None or self.mesh.device_type == "cpu" else torch.device(
            "cuda", torch.cuda.current_device()
        )
        t = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    @property
    def cp(self) -> int:
        return self.config.cp

    def vocab_shard(self, model: nn.Module) -> "VocabShard | None":
        """This rank's share of `model`'s vocabulary when TP split its lm_head (`shards_vocab`)."""
        from ember.engine.vocab_parallel import VocabShard

        tp = self.config.tp
        if not self.is_distributed or not shards_vocab(model, tp):
            return None
        tp_mesh = self.mesh["tp"]
        vocab = int(hf_model(model).get_output_embeddings().weight.shape[0])
        return VocabShard(tp_mesh.get_group(), tp_mesh.get_local_rank(), tp, vocab)

    def cp_group(self) -> "dist.ProcessGroup":
        return self.mesh["cp"].get_group()

    def cp_rank(self) -> int:
        return self.mesh["cp"].get_local_rank()

    def dp_group(self) -> "dist.ProcessGroup":
        """The process group of the ranks that hold distinct tokens (data-parallel and
        context-parallel peers; same TP rank)."""
        if self.config.dp_replicate == 1 and self.config.cp == 1:
            return self.mesh["dp_shard"].get_group()
        if "_dp_pg" not in self.__dict__:  # flattened once; every rank gets here on the same call
            self.__dict__["_dp_pg"] = self.mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp").get_group()
        return self.__dict__["_dp_pg"]

    def sum_over_dp_(self, tensors: list[torch.Tensor]) -> None:
        """In place: SUM each (plain, replicated) tensor over the data- and context-parallel
        ranks, in one all-reduce. Every rank of the group must call it; a no-op without them."""
        if not tensors or self.config.dp_size * self.config.cp == 1 or not self.is_distributed:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group())
        for t, part in zip(tensors, torch.split(flat, [t.numel() for t in tensors])):
            t.copy_(part.view_as(t))
