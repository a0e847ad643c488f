"""`ember tiny-model DIR`: a tiny random-weight model and tokenizer, to try ember in seconds.

It writes an ordinary Hugging Face model directory (config.json, model.safetensors,
tokenizer files with a chat template) that loads with `from_pretrained` and can be given
to `ember serve --model NAME=DIR` or `ember.ServiceClient(models={NAME: DIR})`. Nothing is
downloaded; any real checkpoint directory is used the same way.

The defaults are what a first user needs: a byte-level tokenizer (any text round-trips)
with the chat markers tinker-cookbook's renderers expect as single tokens (`<|im_start|>`,
`<|im_end|>`, `<|endoftext|>`, Llama 3's `<|eot_id|>`, ...), 4096 positions, and
head_dim 32, which every sampler backend serves (vLLM's CPU attention needs >= 32).
`--family` takes any family of `ember.models.families`: `qwen3_vl` / `qwen2_5_vl` write a
vision-language model (a 2-block vision tower in front of the decoder, the image
placeholder tokens in the tokenizer, a chat template that renders image parts as them and
`preprocessor_config.json`, the PIL image processor); `qwen3_moe` / `gpt_oss` /
`qwen3_5_moe` a mixture-of-experts model (4 experts, 2 per token), gpt-oss with a harmony
tokenizer, Qwen3.5-MoE with Qwen3.5's linear-attention layers (`--layers 4` gives its
pattern: three linear, one full) and a shared expert.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# (flag, attribute, lowest, highest): a value outside is refused before anything is built
SIZES = (
    ("--hidden-size", "hidden_size", 1, 4096),
    ("--layers", "layers", 1, 4096),
    ("--heads", "heads", 1, 256),
    ("--max-positions", "max_positions", 16, 1 << 20),
)


def family_choices() -> tuple[str, ...]:
    """Every model family ember has a file for (`ember.models.families`), qwen3 first."""
    from ember.models.families import FAMILIES

    return ("qwen3", *sorted(n for n in FAMILIES if n != "qwen3"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", help="directory to write (must not exist, or be empty)")
    parser.add_argument("--family", choices=family_choices(), default="qwen3",
                        help="architecture (default qwen3; qwen3_vl and qwen2_5_vl add a tiny vision tower, "
                             "the image placeholder tokens and a PIL image processor config; qwen3_moe, "
                             "gpt_oss and qwen3_5_moe are mixture-of-experts models, 4 experts, 2 per token)")
    parser.add_argument("--hidden-size", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--heads", type=int, default=None,
                        help="attention heads (default hidden size / 32, i.e. head_dim 32: vLLM's CPU "
                             "attention serves head_dim 32, 64, 80, ...)")
    parser.add_argument("--max-positions", type=int, default=4096,
                        help="max_position_embeddings, the longest sequence (default 4096)")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default 0)")


def _problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the sizes asked for, or None."""
    for flag, name, low, high in SIZES:
        value = getattr(args, name)
        if value is not None and not low <= value <= high:
            return f"{flag} must be in [{low}, {high}], got {value}"
    if args.heads is None and args.hidden_size % 32:
        return f"--hidden-size must be a multiple of 32 (heads of 32; or give --heads), got {args.hidden_size}"
    if args.heads is not None and args.hidden_size % (2 * args.heads):
        return (f"--hidden-size must be a multiple of 2 x --heads (an even head size, for rotary "
                f"embeddings), got {args.hidden_size} with {args.heads} heads")
    return None


def _heads(args: argparse.Namespace) -> int:
    return args.heads or args.hidden_size // 32


def _extra(family: str) -> str:
    from ember.models.families import FAMILIES

    f = FAMILIES[family]
    return " (with a vision tower)" if f.vision is not None else " (4 experts, 2 per token)" if f.moe else ""


def _chat(family: str) -> str:
    from ember.models.families import FAMILIES

    chat = FAMILIES[family].tiny_chat
    return chat.name if chat is not None else "ChatML"


def run(args: argparse.Namespace) -> int:
    out = Path(args.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"ember tiny-model: {str(out)!r} exists and is not an empty directory", file=sys.stderr)
        return 2
    problem = _problem(args)
    if problem:
        print(f"ember tiny-model: {problem}", file=sys.stderr)
        return 2
    from ember.models.testing import build_tiny_model

    heads = _heads(args)
    build_tiny_model(out, family=args.family, seed=args.seed, tokenizer="bytes", hidden_size=args.hidden_size,
                     num_layers=args.layers, num_heads=heads, num_kv_heads=heads,
                     head_dim=args.hidden_size // heads, max_position_embeddings=args.max_positions)
    print(f"ember tiny-model: wrote a random-weight {args.family}{_extra(args.family)} (hidden {args.hidden_size}, "
          f"{args.layers} layers, {heads} heads of {args.hidden_size // heads}, {args.max_positions} positions) and a "
          f"byte-level tokenizer with a {_chat(args.family)} template to {out}")
    return 0
