"""`ember` command line: a thin dispatcher; each subcommand lives with the layer it drives.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int` and must be
cheap to import (heavy imports inside `run`).
"""

from __future__ import annotations

import argparse
import sys

from ember.registry import load

# name -> (module, help)
SUBCOMMANDS = {
    "serve": ("ember.server.cli", "serve Tinker's HTTP protocol for the official tinker SDK"),
    "demo": ("ember.recipes.demo", "SFT then GRPO on digit sums with a tiny model (CPU, minutes)"),
    "train": ("ember.recipes.train_cli", "run a recipe: ember train sft|grpo|ppo|reward_model|vlm_sft --config file.toml"),
    "tiny-model": ("ember.models.cli", "write a tiny random-weight model + tokenizer to a directory (to try ember)"),
    "limits": ("ember.server.limits_table", "every bound the server enforces (--markdown: README's table)"),
    "hub-link": ("ember.models.hub_link", "make a local model directory answer to a hub id (ember hub-link ORG/NAME DIR)"),
    "estimate": ("ember.engine.estimate_cli", "per-rank memory of training a model: ember estimate --model DIR --tokens N"),
    "doctor": ("ember.doctor", "check this machine for ember: devices, versions, collectives, logprobs (--json)"),
    "admin": ("ember.admin_cli", "the operator's view of a running server: ember admin sessions|runs|checkpoints|"
              "usage|end-session ID|unload-run ID (with its --admin-api-key)"),
    "db": ("ember.service.db_cli", "the service database: ember db upgrade|current --data-dir DIR | --database-url URL"),
}


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """All subcommands are listed; only the `selected` one's module is imported, so a
    problem in one subcommand can never break another (e.g. `ember serve`)."""
    parser = argparse.ArgumentParser(prog="ember", description="ember: self-hosted post-training engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == selected:
            module = load(module_name)
            module.add_arguments(sp)
            sp.set_defaults(command_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    selected = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(selected if selected in SUBCOMMANDS else None).parse_args(argv)
    return int(args.command_module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
