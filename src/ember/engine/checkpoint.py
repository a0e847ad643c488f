"""Engine checkpoints with torch.distributed.checkpoint (DCP), and HF/peft exports.

Layout of a `save_state` directory:
  *.distcp, .metadata   DCP shards: {"model": {name: tensor}, "optim": {name: {slot: tensor}}}
                        (AdamW: step, exp_avg, exp_avg_sq; Dimuon: step, momentum)
  ember_state.json      kind (full | lora), LoRA config, optimizer step, whether optimizer state is
                        inside, which optimizer (absent in older checkpoints: adamw), and the
                        run's head ("policy" | "value"; absent in older checkpoints: policy)
                        with its shape (`head_config`)

A value head's tensors ride with the model's as `head.score.weight` / `head.score.bias`
(and their optimizer slots). A checkpoint loads only into a run with the same head.
  rng_rank<r>.pt        torch RNG state of each rank (exact resume)

Tensors are keyed by names independent of the adapter's name, so a checkpoint of one LoRA
run loads into another run with the same LoRA config. DCP writes DTensors shard by shard
and reshards on load, so the same directory loads at any world size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from peft import get_peft_model_state_dict

from ember.engine import hf_export
from ember.errors import UserError

if TYPE_CHECKING:
    from ember.engine.torch_engine import TorchEngine

META = "ember_state.json"
FORMAT_VERSION = 1


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _meta(engine: "TorchEngine", optimizer: bool) -> dict:
    vision = {"train_vision": engine.config.train_vision} if getattr(engine, "vision", None) is not None else {}
    return vision | {
        "format_version": FORMAT_VERSION,
        "kind": "lora" if engine.is_lora else "full",
        "lora_config": engine.lora_config.model_dump() if engine.is_lora else None,
        "model_name": engine.model_name,
        "model_type": str(engine.hf_config.model_type),
        "step": engine.step,
        "has_optimizer": optimizer,
        "optimizer": engine.optimizer.name,
        "head": engine.head.name,
        "head_config": _head_config(engine),
    }


def _head_config(engine: "TorchEngine") -> dict | None:
    state = engine.head_weights()
    if not state:
        return None
    return {"type": "linear", "hidden_size": int(state["score.weight"].shape[1]), "bias": "score.bias" in state}


def _optim_state(engine: "TorchEngine", init: bool,
                 saved: set[str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """Optimizer slots keyed like the model tensors; with `init`, allocate empty slots to load
    into, for the tensors whose state is in `saved` (DCP keys) — the others stay fresh."""
    opt = engine.optimizer
    out = {}
    for name, p in engine.state_tensors().items():
        state = opt.state[p]
        if init and not state and (saved is None or f"optim.{name}.{opt.slots[-1]}" in saved):
            state.update(opt.init_state(p))
        if state:
            out[name] = {k: state[k] for k in opt.slots}
    return out


def save(engine: "TorchEngine", path: Path, optimizer: bool = True) -> None:
    path.mkdir(parents=True, exist_ok=True)
    state = {"model": {n: p.detach() for n, p in engine.state_tensors().items()}}
    if optimizer:
        state["optim"] = _optim_state(engine, init=False)
    dcp.save(state, checkpoint_id=str(path))
    torch.save({"cpu": torch.get_rng_state()}, path / f"rng_rank{_rank()}.pt")
    if _rank() == 0:
        (path / META).write_text(json.dumps(_meta(engine, optimizer), indent=2))


def read_meta(path: Path) -> dict:
    meta_file = path / META
    if not meta_file.is_file():
        raise UserError(f"{str(path)!r} is not an ember checkpoint (no {META})")
    return json.loads(meta_file.read_text())


def _check_compatible(engine: "TorchEngine", meta: dict, path: Path) -> None:
    head = meta.get("head", "policy")
    if head != engine.head.name:
        raise UserError(f"checkpoint {str(path)!r} holds a {head}-head run; this run has a {engine.head.name} "
                         f"head (user_metadata['ember.head'] = {engine.head.name!r})")
    kind = "lora" if engine.is_lora else "full"
    if meta["kind"] != kind:
        raise UserError(f"checkpoint {str(path)!r} holds {meta['kind']} weights; this run trains {kind} weights")
    tower = meta.get("train_vision", False)
    if kind == "full" and getattr(engine, "vision", None) is not None and tower != engine.config.train_vision:
        raise UserError(f"checkpoint {str(path)!r} was saved with train_vision={tower} (its vision tower "
                         f"{'trained' if tower else 'frozen'}); this engine has train_vision="
                         f"{engine.config.train_vision}")
    if engine.is_lora:
        mine, theirs = engine.lora_config.model_dump(), dict(meta["lora_config"])
        mine.pop("seed", None), theirs.pop("seed", None)
        if mine != theirs:
            raise UserError(f"checkpoint {str(path)!r} has LoRA config {theirs}; this run has {mine}")


def _saved_keys(path: Path) -> set[str]:
    """The flattened keys (`optim.<name>.exp_avg`, ...) a DCP checkpoint holds."""
    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def load(engine: "TorchEngine", path: Path, optimizer: bool = True) -> None:
    meta = read_meta(path)
    _check_compatible(engine, meta, path)
    if optimizer and not meta["has_optimizer"]:
        raise UserError(f"checkpoint {str(path)!r} was saved without optimizer state")
    saved_opt = meta.get("optimizer", "adamw")
    if optimizer and saved_opt != engine.optimizer.name:
        raise UserError(f"checkpoint {str(path)!r} holds {saved_opt} optimizer state; this run's optimizer is "
                         f"{engine.optimizer.name}")
    with torch.no_grad():
        state = {"model": {n: p.detach() for n, p in engine.state_tensors().items()}}
        if optimizer:
            engine.reset_optimizer(step=meta["step"])
            # A save before the first optim_step has no Adam moments yet: those load as fresh.
            optim = _optim_state(engine, init=True, saved=_saved_keys(path))
            if optim:
                state["optim"] = optim
        dcp.load(state, checkpoint_id=str(path))  # in place into the (possibly sharded) tensors
    if not optimizer:
        engine.reset_optimizer(step=0)
    rng_file = path / f"rng_rank{_rank()}.pt"
    if optimizer and rng_file.is_file():
        torch.set_rng_state(torch.load(rng_file, weights_only=True)["cpu"])


def export_hf(engine: "TorchEngine", path: Path) -> None:
    """safetensors that `from_pretrained` (full FT) or `PeftModel.from_pretrained` (LoRA) loads;
    a value head's run as a token classifier (`ember.engine.hf_export`)."""
    path.mkdir(parents=True, exist_ok=True)
    head = engine.head_weights()
    if not engine.is_lora:
        state = {n: t for n, t in engine.named_weights()}
        if _rank() == 0 and head:
            config = hf_export.token_classification_config(json.loads(engine.hf_config.to_json_string()))
            hf_export.write_model(path, hf_export.value_model_weights(state.items(), head), config, None)
        elif _rank() == 0:
            engine.model.save_pretrained(path, state_dict=state, safe_serialization=True)
        return
    state = get_peft_model_state_dict(engine.model, adapter_name=engine.adapter_name, save_embedding_layers=False)
    # FSDP2/TP: every rank gathers each full tensor (a collective), rank 0 writes them.
    adapter = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).contiguous() for n, t in state.items()}
    if _rank() != 0:
        return
    peft_cfg = engine.model.peft_config[engine.adapter_name]
    hf_export.write_lora_adapter(path, adapter, rank=peft_cfg.r, alpha=peft_cfg.lora_alpha,
                                 base_model=peft_cfg.base_model_name_or_path or engine.model_name, head=head or None,
                                 exclude_modules=peft_cfg.exclude_modules,
                                 target_parameters=sorted(peft_cfg.target_parameters or ()) or None)
