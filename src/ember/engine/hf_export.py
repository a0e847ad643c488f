"""Hugging Face-format exports of trained weights: pure functions from tensors to a directory.

    write_lora_adapter(out, adapter, rank=..., alpha=..., base_model=..., base_dir=...)
        adapter_config.json + adapter_model.safetensors (+ the base model's tokenizer files):
        `peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out)`.
    write_full_model(out, merge_lora(read_base_weights(base_dir), adapter, scale=..., config=...), base_dir)
        the same, with a LoRA adapter merged into the base weights (W + scale * B @ A; a
        mixture-of-experts model's expert adapters into its expert weights, either layout).
    write_full_model(out, weights, base_dir)
        config.json + model.safetensors (or shards + model.safetensors.index.json when larger
        than `max_shard_bytes`) + generation_config.json + tokenizer files:
        `AutoModelForCausalLM.from_pretrained(out)`.
    write_value_model(out, weights, head, base_dir)
        a value-head run (full fine-tuning) as a token classifier with one label: the base
        config with `architectures` set to the model family's `value_head_class`, the
        backbone's `model.*` tensors and the head's `score.weight` / `score.bias`, no
        `lm_head`: `AutoModelForTokenClassification.from_pretrained(out)`.
    write_lora_adapter(out, adapter, ..., head=head)
        a value-head LoRA run: a `TOKEN_CLS` adapter with `modules_to_save=["score"]` and the
        head as `base_model.model.score.*`: `PeftModel.from_pretrained(
        AutoModelForTokenClassification.from_pretrained(base, num_labels=1), out)`.

`adapter` holds PEFT's saved-adapter names (`base_model.model.<module>.lora_A.weight`), as
`TrainingEngine.named_weights` yields them for a LoRA run; `weights` the base model's HF
parameter names (full fine-tuning). Tensors are written as they come (dtype kept); the
full-model writer streams them into shards, so at most one shard is held in memory.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace

import safetensors.torch
import torch

# the adapter's file names and targets, as exports' readers know them from here
from ember.errors import UserError
from ember.models.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, write_peft_adapter
from ember.models.adapter import adapter_target_modules as lora_target_modules
from ember.models.experts import expert_delta, expert_weight_name, num_experts, part_rows, per_expert_slot
from ember.models.families import FAMILIES

MODEL_WEIGHTS = "model.safetensors"
MODEL_INDEX = "model.safetensors.index.json"
# Files of a model directory that describe the model or its tokenizer (never weights); a
# vision-language model's image processor (and processor) configs go along.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
)
DEFAULT_MAX_SHARD_BYTES = 5 << 30


def copy_model_files(base_dir: Path, out: Path, names: Iterable[str]) -> list[str]:
    """Copy those of `names` that exist as files in `base_dir` (an operator-configured model
    directory, so links are followed) into `out`; returns the names copied."""
    copied = []
    for name in names:
        src = Path(base_dir) / name
        if src.is_file():
            shutil.copyfile(src, out / name)
            copied.append(name)
    return copied


VALUE_LABEL = "VALUE"


def _check_head(head: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    names = sorted(head)
    if names != ["score.bias", "score.weight"]:
        raise ValueError(f"a value head holds score.bias and score.weight; got {names}")
    if head["score.weight"].dim() != 2 or head["score.weight"].shape[0] != 1 or head["score.bias"].shape != (1,):
        raise ValueError(f"a value head is Linear(hidden, 1): score.weight (1, H) and score.bias (1,); got "
                         f"{tuple(head['score.weight'].shape)} and {tuple(head['score.bias'].shape)}")
    return {n: t.detach().to("cpu").contiguous() for n, t in head.items()}


def write_lora_adapter(out: Path, adapter: dict[str, torch.Tensor], *, rank: int, alpha: int, base_model: str,
                       base_dir: Path | None = None, head: dict[str, torch.Tensor] | None = None,
                       exclude_modules: str | None = None, target_parameters: list[str] | None = None) -> None:
    """A peft adapter directory for `adapter` (`ember.models.adapter.write_peft_adapter`),
    with the tokenizer files of `base_dir` when given. `exclude_modules` (peft's): the
    modules the adapter's suffixes must not match (a vision tower, `ember.models.lora.
    lora_exclude_modules`); read from `base_dir`'s config when not given.

    With `head` (a value head's `score.weight` / `score.bias`): a `TOKEN_CLS` adapter that
    saves the head beside it (`modules_to_save=["score"]`, tensors `base_model.model.score.*`).
    `target_parameters` (peft's: a mixture-of-experts model's adapted expert weights) is
    read from `base_dir`'s config when not given and the adapter holds expert factors."""
    if exclude_modules is None and base_dir is not None:
        exclude_modules = _exclude_modules(Path(base_dir))
    if target_parameters is None and base_dir is not None:
        target_parameters = _target_parameters(Path(base_dir), adapter)
    if head is None:
        write_peft_adapter(out, adapter, rank=rank, alpha=alpha, base_model=base_model,
                           exclude_modules=exclude_modules, target_parameters=target_parameters)
    else:
        tensors = dict(adapter) | {"base_model.model." + n: t for n, t in _check_head(head).items()}
        write_peft_adapter(out, tensors, rank=rank, alpha=alpha, base_model=base_model, task_type="TOKEN_CLS",
                           modules_to_save=["score"], target_parameters=target_parameters)
    if base_dir is not None:
        copy_model_files(base_dir, out, TOKENIZER_FILES)


def _exclude_modules(base_dir: Path) -> str | None:
    from ember.models.lora import lora_exclude_modules

    config = json.loads((base_dir / "config.json").read_text()) if (base_dir / "config.json").is_file() else {}
    return lora_exclude_modules(SimpleNamespace(model_type=config.get("model_type")))


def _target_parameters(base_dir: Path, adapter: dict[str, torch.Tensor]) -> list[str] | None:
    """The family's expert weights when `adapter` adapts any (`ember.models.experts`), else None."""
    config = json.loads((base_dir / "config.json").read_text()) if (base_dir / "config.json").is_file() else {}
    family = FAMILIES.get(str(config.get("model_type", "")))
    if family is None or family.moe is None:
        return None
    if any(expert_weight_name(module, family.moe) for module in _lora_pairs(adapter)):
        return list(family.lora.experts)
    return None


def write_full_model(out: Path, weights: Iterable[tuple[str, torch.Tensor]], base_dir: Path, *,
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """A transformers model directory: the base model's config (dtype set to the weights'),
    generation config and tokenizer files, and `weights` as safetensors shards."""
    config = json.loads((Path(base_dir) / "config.json").read_text())
    untie: list[bool] = []
    kept = _drop_tied_head(weights, config, untie) if config.get("tie_word_embeddings", False) else weights
    write_model(out, kept, config, base_dir, max_shard_bytes=max_shard_bytes, untie=untie)


def token_classification_config(base_config: dict) -> dict:
    """A causal LM's config as a one-label token classifier's (a value head's export):
    `architectures` the family's `value_head_class` (`ember.models.families`), label VALUE,
    `ember_head`. A model_type without a family maps `XForCausalLM -> XForTokenClassification`."""
    config = dict(base_config)
    config["architectures"] = [value_head_class(base_config)]
    config["id2label"], config["label2id"] = {"0": VALUE_LABEL}, {VALUE_LABEL: 0}
    config["ember_head"] = "value"
    return config


def value_head_class(base_config: dict) -> str:
    """The token classifier a causal LM's config maps to: its family's, else `X` of `XForCausalLM`."""
    archs = base_config.get("architectures") or []
    causal = [a for a in archs if isinstance(a, str) and a.endswith("ForCausalLM")]
    if not causal:
        raise ValueError(f"config.json architectures must name an XForCausalLM class to map to "
                         f"XForTokenClassification; got {archs!r}")
    family = FAMILIES.get(str(base_config.get("model_type", "")))
    if family is None:
        return causal[0].removesuffix("ForCausalLM") + "ForTokenClassification"
    if family.value_head_class is None:
        raise UserError(f"model family {family.model_type!r} has no transformers token-classification class "
                         f"to export a value head as (its training checkpoint keeps the head)")
    return family.value_head_class


def write_value_model(out: Path, weights: Iterable[tuple[str, torch.Tensor]], head: dict[str, torch.Tensor],
                      base_dir: Path, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """A value-head run as a transformers token classifier with one label (see the module
    docstring): `weights` are the backbone's (an `lm_head.weight` among them is left out),
    `head` the head's `score.weight` / `score.bias`; config and tokenizer from `base_dir`."""
    config = token_classification_config(json.loads((Path(base_dir) / "config.json").read_text()))
    write_model(out, value_model_weights(weights, head), config, base_dir, max_shard_bytes=max_shard_bytes)


def value_model_weights(weights: Iterable[tuple[str, torch.Tensor]],
                        head: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The backbone without `lm_head.weight`, then the head's tensors."""
    head = _check_head(head)
    for name, t in weights:
        if name != "lm_head.weight":
            yield name, t
    yield from head.items()


def write_model(out: Path, weights: Iterable[tuple[str, torch.Tensor]], config: dict, base_dir: Path | None, *,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, untie: list[bool] | None = None) -> None:
    """`weights` as safetensors shards + `config` (dtype set to the weights' when they have one),
    with the generation config and tokenizer files of `base_dir` when given. `untie` is
    filled while `weights` streams (see `_drop_tied_head`)."""
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    out.mkdir(parents=True, exist_ok=True)
    dtypes: set[torch.dtype] = set()
    shards = _write_shards(out, weights, max_shard_bytes, dtypes)
    if untie:  # the trained head no longer equals the embedding: keep both, untied
        config["tie_word_embeddings"] = False
    if not shards:
        raise ValueError("no weights to export")
    floating = sorted(str(d).removeprefix("torch.") for d in dtypes if d.is_floating_point)
    if len(floating) == 1:  # what from_pretrained loads them as by default ("auto")
        config["torch_dtype"] = floating[0]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if base_dir is not None:
        copy_model_files(base_dir, out, ("generation_config.json", *TOKENIZER_FILES))
    _name_shards(out, shards)


def _drop_tied_head(weights: Iterable[tuple[str, torch.Tensor]], config: dict,
                    untie: list[bool]) -> Iterable[tuple[str, torch.Tensor]]:
    """Leave out `lm_head.weight` when it equals the input embedding (tied: transformers
    ties it back on load). A head that differs is kept, and `untie` gets an entry."""
    embedding = None
    for name, t in weights:
        if embedding is None and name.endswith(("embed_tokens.weight", "wte.weight", "word_embeddings.weight")):
            embedding = t.detach().to("cpu")
        if name == "lm_head.weight":
            if embedding is not None and embedding.shape == t.shape and torch.equal(embedding, t.detach().to("cpu")):
                continue
            untie.append(True)
        yield name, t


def _write_shards(out: Path, weights: Iterable[tuple[str, torch.Tensor]],
                  max_shard_bytes: int, dtypes: set[torch.dtype]) -> list[tuple[str, list[str]]]:
    """Stream tensors into `.shard-<i>.safetensors` files of at most `max_shard_bytes`
    (a single larger tensor gets its own); returns (file, tensor names) per shard."""
    shards: list[tuple[str, list[str]]] = []
    pending: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal pending, size
        if pending:
            name = f".shard-{len(shards):05d}.safetensors"
            safetensors.torch.save_file(pending, str(out / name), metadata={"format": "pt"})
            shards.append((name, list(pending)))
            pending, size = {}, 0

    for name, t in weights:
        nbytes = t.numel() * t.element_size()
        if pending and size + nbytes > max_shard_bytes:
            flush()
        pending[name] = t.detach().to("cpu").contiguous()
        dtypes.add(t.dtype)
        size += nbytes
    flush()
    return shards


def _name_shards(out: Path, shards: list[tuple[str, list[str]]]) -> None:
    """Give the shards transformers' names; more than one also gets the index file."""
    if len(shards) == 1:
        os.rename(out / shards[0][0], out / MODEL_WEIGHTS)
        return
    weight_map, total = {}, 0
    for i, (tmp, names) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += (out / tmp).stat().st_size
        os.rename(out / tmp, out / final)
        weight_map.update({n: final for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / MODEL_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))


def read_base_weights(base_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a model directory's safetensors files, one at a time, as stored."""
    files = sorted(Path(base_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{str(base_dir)!r} holds no safetensors weights to merge into")
    for f in files:
        with safetensors.safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def _lora_pairs(adapter: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module path (as in the base checkpoint) -> (A, B), from PEFT's saved-adapter names."""
    pairs = {}
    for name in adapter:
        if name.endswith(".lora_A.weight"):
            module = name.removesuffix(".lora_A.weight").removeprefix("base_model.model.")
            b = adapter.get(name.replace(".lora_A.weight", ".lora_B.weight"))
            if b is None:
                raise ValueError(f"adapter tensor {name} has no lora_B partner")
            pairs[module] = (adapter[name], b)
    if not pairs:
        raise ValueError("the adapter holds no lora_A/lora_B tensors")
    return pairs


def _merged(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    return _added(w, scale * (b.detach().to("cpu", torch.float32) @ a.detach().to("cpu", torch.float32)))


class _ExpertMerge:
    """The expert part of a merge: each adapted fused expert weight's update
    (`ember.models.experts.expert_delta`), added to the fused weight or, for a hub
    checkpoint's per-expert tensors, to each expert's rows of it (one weight's update is
    kept while its experts stream by)."""

    def __init__(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], config: dict | None, scale: float):
        family = FAMILIES.get(str((config or {}).get("model_type", "")))
        self.layout = family.moe if family is not None else None
        self.pairs: dict[str, tuple[str, torch.Tensor, torch.Tensor]] = {}
        if self.layout is not None:
            self.num_experts = num_experts(config, self.layout)
            for module, (a, b) in pairs.items():
                weight = expert_weight_name(module, self.layout)
                if weight is not None:
                    self.pairs[weight] = (module, a, b)
        self.scale, self.cached = scale, ("", None)

    def delta(self, weight: str) -> torch.Tensor:
        if self.cached[0] != weight:
            _, a, b = self.pairs[weight]
            a, b = a.detach().to("cpu", torch.float32), b.detach().to("cpu", torch.float32)
            self.cached = (weight, expert_delta(a, b, self.num_experts, self.layout.transposed, self.scale))
        return self.cached[1]

    def merged(self, name: str, w: torch.Tensor) -> tuple[str | None, torch.Tensor]:
        """(the adapter module merged, the weight): (None, w) when no expert update applies."""
        if name in self.pairs:
            return self.pairs[name][0], _added(w, self.delta(name))
        slot = per_expert_slot(name, self.layout) if self.layout is not None else None
        if slot is None or slot[0] not in self.pairs:
            return None, w
        weight, e, part, parts = slot
        return self.pairs[weight][0], _added(w, part_rows(self.delta(weight)[e], part, parts))


def _added(w: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """w + delta computed in fp32, in w's dtype."""
    if delta.shape != w.shape:
        raise ValueError(f"LoRA update of shape {tuple(delta.shape)} does not fit a weight of shape {tuple(w.shape)}")
    return (w.to(torch.float32) + delta).to(w.dtype)


def merge_lora(base: Iterable[tuple[str, torch.Tensor]], adapter: dict[str, torch.Tensor], *, scale: float,
               tied_head: bool = False, config: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The base weights with `scale * B @ A` added to every weight the adapter targets.

    With `tied_head` and a checkpoint that stores no `lm_head.weight`, an adapter on
    `lm_head` is merged into a copy of the input embedding (then written untied). `config`
    (the base model's config.json) names a mixture-of-experts family: its expert adapters
    merge into the fused expert weights, or into a hub checkpoint's per-expert tensors
    (`ember.models.experts`). Every adapter module must be found in `base` (else
    ValueError naming them)."""
    pairs, used, embedding = _lora_pairs(adapter), set(), None
    experts = _ExpertMerge(pairs, config, scale)
    for name, w in base:
        module = name.removesuffix(".weight")
        if tied_head and embedding is None and name.endswith("embed_tokens.weight"):
            embedding = w
        if name.endswith(".weight") and module in pairs:
            used.add(module)
            w = _merged(w, *pairs[module], scale)
        else:
            merged_module, w = experts.merged(name, w)
            if merged_module is not None:
                used.add(merged_module)
        yield name, w
    if tied_head and "lm_head" in pairs and "lm_head" not in used and embedding is not None:
        used.add("lm_head")
        yield "lm_head.weight", _merged(embedding, *pairs["lm_head"], scale)
    missing = sorted(set(pairs) - used)
    if missing:
        raise ValueError(f"adapter modules not found in the base checkpoint: {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''} (merging needs the base weights under the "
                         "model's own module names)")
