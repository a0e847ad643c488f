"""`ember tiny-model DIR`: a tiny random-weight model and tokenizer, to try ember in seconds.

It writes an ordinary Hugging Face model directory (config.json, model.safetensors,
tokenizer files with a chat template) that loads with `from_pretrained` and can be given
to `ember serve --model NAME=DIR` or `ember.ServiceClient(models={NAME: DIR})`. Nothing is
downloaded; any real checkpoint directory is used the same way.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", help="directory to write (must not exist, or be empty)")
    parser.add_argument("--family", choices=("qwen3", "llama"), default="qwen3", help="architecture (default qwen3)")
    parser.add_argument("--hidden-size", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default 0)")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"ember tiny-model: {str(out)!r} exists and is not an empty directory", file=sys.stderr)
        return 2
    for name in ("hidden_size", "layers"):
        if not 1 <= getattr(args, name) <= 4096:
            print(f"ember tiny-model: --{name.replace('_', '-')} must be in [1, 4096], got {getattr(args, name)}",
                  file=sys.stderr)
            return 2
    if args.hidden_size % 4:
        print(f"ember tiny-model: --hidden-size must be a multiple of 4 (4 heads), got {args.hidden_size}",
              file=sys.stderr)
        return 2
    from ember.models.testing import build_tiny_model

    build_tiny_model(out, family=args.family, seed=args.seed, hidden_size=args.hidden_size,
                     num_layers=args.layers, head_dim=args.hidden_size // 4)
    print(f"ember tiny-model: wrote a random-weight {args.family} (hidden {args.hidden_size}, "
          f"{args.layers} layers) and its tokenizer to {out}")
    return 0
