"""Load causal LMs and tokenizers through transformers' real `from_pretrained` path.

Only local directories are used here: ember never downloads from a hub at run time
(set `HF_HUB_OFFLINE=1` to make that explicit; the loaders pass `local_files_only`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ember.models.dtypes import dtype_name
from ember.models.families import family_of, vision_of


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a config string ('float32', 'bf16', ...) or a torch dtype to a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, dtype_name(dtype))


def _check_dir(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(
            f"model directory {str(p)!r} does not exist; ember loads models from local "
            "directories only (register a name with --model NAME=DIR)"
        )
    return p


def model_class(config) -> type:
    """The transformers class a config loads through: `AutoModelForCausalLM`, or a
    vision-language family's own class (`VisionFamily.model_class`: transformers maps
    those to no causal-LM auto class)."""
    vision = vision_of(config)
    return AutoModelForCausalLM if vision is None else getattr(transformers, vision.model_class)


def effective_attention(config, requested: str) -> str:
    """The attention implementation a model of `config` runs with when `requested` is
    asked for: the family's own (`ModelFamily.attention`, gpt-oss's "eager": transformers
    has no SDPA kernel with attention sinks) in place of the default "sdpa"; anything
    else as asked."""
    family = family_of(config)
    if requested == "sdpa" and family is not None and family.attention is not None:
        return family.attention
    return requested


def load_model(
    path: str | os.PathLike,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """Load a causal LM from a local directory with `AutoModelForCausalLM.from_pretrained`.

    `sdpa` attention is the default: with `position_ids` restarting per sequence and no
    attention mask, transformers builds a block-diagonal causal mask, which is what
    ember's sequence packing relies on (see `ember.engine.batching`); a family without an
    SDPA kernel loads with its own (`effective_attention`). A vision-language model loads
    through its family's class (`model_class`), vision tower included.
    """
    p = _check_dir(path)
    config = AutoConfig.from_pretrained(p, local_files_only=True)
    model = model_class(config).from_pretrained(
        p,
        config=config,  # read once: from the path, transformers would parse config.json again
        dtype=resolve_dtype(dtype),
        attn_implementation=effective_attention(config, attn_implementation),
        local_files_only=True,
    )
    return model.to(device)


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved beside a model (or in its own directory)."""
    return AutoTokenizer.from_pretrained(_check_dir(path), local_files_only=True)
