"""What a training run is created with, checked: LoRA config, optimizer, head, ids.

Pure functions over the request's values (and, for a run created from a checkpoint, the
checkpoint's `meta.json`); each refuses with a `UserError` naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tinker import types

from ember.service.api import UserError
from ember.service.engines import RunSpec


SEED_MIN, SEED_END = -(2**63), 2**64  # what torch.manual_seed accepts


def is_seq_id(seq_id: Any) -> bool:
    """A well-formed seq_id or model_seq_id: an int >= 0 (not a bool)."""
    return isinstance(seq_id, int) and not isinstance(seq_id, bool) and seq_id >= 0


def validate_model_seq_id(model_seq_id: Any) -> int:
    if not is_seq_id(model_seq_id):
        raise UserError(f"model_seq_id must be an integer >= 0, got {model_seq_id!r}")
    return model_seq_id


def validate_lora(cfg: types.LoraConfig | None) -> None:
    if cfg is None:
        return
    if not isinstance(cfg.rank, int) or cfg.rank < 1:
        raise UserError(f"lora_config.rank must be an integer >= 1, got {cfg.rank!r}")
    if not (cfg.train_attn or cfg.train_mlp or cfg.train_unembed):
        raise UserError("lora_config must train at least one of attn, mlp, unembed")
    seed = cfg.seed  # torch's generators take [-2**63, 2**64); checked here, not left to torch's ValueError
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed < SEED_END):
        raise UserError(f"lora_config.seed must be an integer in [-2**63, 2**64) or null, got {seed!r}")


def validate_head(user_metadata: Mapping[str, Any] | None) -> str:
    """The run's head, from `user_metadata["ember.head"]` ("policy" when absent)."""
    from ember.engine.heads import head_from_metadata

    return head_from_metadata(user_metadata)  # UserError naming the key, the known heads and the value


def check_samplable(spec: RunSpec) -> None:
    """Only a policy has a sampler: a value head outputs a number per token, not a distribution
    over tokens, and its adapter on the LM would sample from something nobody trained."""
    if spec.head != "policy":
        raise UserError(f"run {spec.run_id} has a {spec.head!r} head (user_metadata['ember.head']): it outputs "
                        "values, not tokens, so it has no sampler; read its values with forward, save it with "
                        "save_state or save_weights_external")


def saved_head(meta: Mapping[str, Any] | None, user_metadata: Mapping[str, Any] | None) -> str:
    """The head of a run created from a training checkpoint of metadata `meta`
    (`CheckpointStore.meta`): the checkpoint's (it holds the head's weights). Metadata naming
    another head is refused rather than ignored."""
    from ember.engine.heads import HEAD_METADATA_KEY

    saved = "policy" if meta is None else meta.get("head", "policy")  # None: load_state reports the unreadable
    if user_metadata and HEAD_METADATA_KEY in user_metadata and validate_head(user_metadata) != saved:
        raise UserError(f"user_metadata[{HEAD_METADATA_KEY!r}] is {user_metadata[HEAD_METADATA_KEY]!r}, but the "
                        f"checkpoint holds a {saved!r}-head run; leave the key out or set it to {saved!r}")
    return saved


def saved_optimizer(meta: Mapping[str, Any] | None) -> dict[str, Any]:
    """The optimizer config a training checkpoint's state belongs to (AdamW for older ones)."""
    kind = "adamw" if meta is None else meta.get("optimizer", "adamw")  # None: load_state reports the unreadable
    return validate_optimizer({"type": kind})


def resumed_optimizer(meta: Mapping[str, Any] | None, with_state: bool,
                      requested: Mapping[str, Any] | None) -> dict[str, Any]:
    """The optimizer of a run created from a checkpoint of metadata `meta` (`CheckpointStore.meta`):
    the saved one with its state, or the requested one (default AdamW) started fresh."""
    if not with_state:
        return validate_optimizer(requested)
    saved = saved_optimizer(meta)
    if requested is not None and validate_optimizer(requested)["type"] != saved["type"]:
        raise UserError(f"optimizer_config: the checkpoint's optimizer state is {saved['type']!r}, "
                        f"got a {requested.get('type')!r} config; load it without optimizer state to switch")
    return saved


def validate_optimizer(cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """The run's optimizer config, checked against its `ember.engine.optimizers.OPTIMIZERS`
    entry (AdamW by default); a user error naming what is wrong."""
    from ember.engine.optimizers import optimizer_config

    return optimizer_config(cfg)  # UserError naming what is wrong


def model_arch(directory: Path) -> str | None:
    try:
        return json.loads((directory / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None
