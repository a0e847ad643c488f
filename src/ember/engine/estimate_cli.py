"""`ember estimate --model DIR --tokens N [--lora-rank R] [--optimizer adamw|dimuon]
[--engine.KEY VALUE ...] [--parallel.KEY VALUE ...] [--json]`: the per-rank memory of
training DIR (only its config.json is read) with one micro-batch of N tokens, without
allocating anything (`ember.engine.estimate`)."""

from __future__ import annotations

import argparse
import dataclasses
import json


def _section_fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ember.engine.config import EngineConfig
    from ember.engine.parallel import ParallelismConfig

    parser.add_argument("--model", required=True, metavar="DIR", help="model directory (config.json is enough)")
    parser.add_argument("--tokens", type=int, required=True, metavar="N", help="tokens of one micro-batch")
    parser.add_argument("--lora-rank", type=int, default=None, metavar="R", help="LoRA rank (default: full fine-tuning)")
    parser.add_argument("--optimizer", choices=["adamw", "dimuon"], default="adamw")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    for section, cls in (("engine", EngineConfig), ("parallel", ParallelismConfig)):
        group = parser.add_argument_group(f"--{section}.KEY VALUE", f"{cls.__name__} fields")
        for name in _section_fields(cls):
            group.add_argument(f"--{section}.{name}", dest=f"{section}__{name}", default=None, metavar="VALUE")


def _section(args: argparse.Namespace, section: str, cls):
    from ember.config import from_dict, parse_overrides

    overrides = [f"--{name}={value}" for name in _section_fields(cls)
                 if (value := getattr(args, f"{section}__{name}")) is not None]
    return from_dict(cls, parse_overrides(overrides), prefix=f"{section}.")


def run(args: argparse.Namespace) -> int:
    import sys

    from ember.engine.config import EngineConfig
    from ember.engine.estimate import estimate_memory
    from ember.engine.parallel import ParallelismConfig

    try:
        engine = _section(args, "engine", EngineConfig)
        parallel = _section(args, "parallel", ParallelismConfig)
        est = estimate_memory(args.model, engine=engine, parallel=parallel, tokens=args.tokens,
                              lora_rank=args.lora_rank, optimizer=args.optimizer)
    except (ValueError, OSError) as exc:
        print(f"ember estimate: {exc}", file=sys.stderr)
        return 2
    lines = est.lines()
    if engine.float8:  # the figures assume the stored/compute dtype throughout
        lines.append(FLOAT8_NOTE)
    print(json.dumps(est.as_dict()) if args.json else "\n".join(lines))
    return 0


# float8 keeps the weights, gradients and optimizer state in their stored dtype and saves
# float8 copies of the linear layers' inputs for backward in place of bf16 ones: the
# estimate does not model that saving, so its figures are an upper bound for a float8 run.
FLOAT8_NOTE = ("  note: --engine.float8 is ignored by the estimate (figures as without it: an upper bound; "
               "float8 saves 1-byte copies of linear inputs for backward)")
