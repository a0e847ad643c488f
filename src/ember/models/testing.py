"""Tiny models and tokenizers built in code, for tests, benchmarks and the demo.

Nothing here downloads anything: a tokenizer is trained with the `tokenizers` library on
a small corpus, a model is built from a transformers config with random weights, both
are saved to a directory and are meant to be loaded back through the real
`from_pretrained` path (`ember.models.load_model` / `load_tokenizer`).
"""

from __future__ import annotations

import os
import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from ember.models.families import FAMILIES

EOS = "<|eos|>"
PAD = "<|pad|>"
UNK = "<|unk|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
SYSTEM = "<|system|>"
SPECIAL_TOKENS = [PAD, EOS, UNK, SYSTEM, USER, ASSISTANT]

DEFAULT_ALPHABET = string.ascii_letters + string.digits + " :.,?!+-=*/()'\"\n"

# Each message is "<|role|>content<|eos|>"; a generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|eos|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tokenizer(
    out_dir: str | os.PathLike,
    corpus: list[str] | None = None,
    alphabet: str = DEFAULT_ALPHABET,
    vocab_size: int | None = None,
) -> PreTrainedTokenizerFast:
    """Train a BPE tokenizer in code and save it (with EOS, PAD and a chat template).

    With `vocab_size=None` no merges are learned: one token per character of `alphabet`,
    which is what small arithmetic tasks want. Pass a corpus and a larger `vocab_size`
    for a tokenizer with merges.
    """
    chars = sorted(set(alphabet))
    size = vocab_size or (len(chars) + len(SPECIAL_TOKENS))
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.decoder = decoders.Fuse()  # concatenate pieces; no spaces invented between chars
    trainer = trainers.BpeTrainer(
        vocab_size=size, special_tokens=SPECIAL_TOKENS, initial_alphabet=chars, show_progress=False
    )
    tok.train_from_iterator(corpus or [alphabet], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT],
    )
    fast.chat_template = CHAT_TEMPLATE
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def tiny_config(
    family: str,
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
):
    """A transformers config for a tiny model of `family` (a key of `FAMILIES`; each family
    file's `tiny_config` builds it), head_dim always explicit."""
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; expected one of {sorted(FAMILIES)}")
    return FAMILIES[family].tiny_config(**kwargs)


def build_tiny_model(
    out_dir: str | os.PathLike,
    family: str = "qwen3",
    seed: int = 0,
    tokenizer_alphabet: str = DEFAULT_ALPHABET,
    **config_kwargs,
) -> Path:
    """Build a tokenizer and a random-weight model in `out_dir`; return the directory.

    Load it back with `ember.models.load_model(out_dir)` / `load_tokenizer(out_dir)`.
    """
    out = Path(out_dir)
    tok = build_tokenizer(out, alphabet=tokenizer_alphabet)
    cfg = tiny_config(
        family, vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        **config_kwargs,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    return out


def target_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """Log-probs of tokens[1:] given their prefixes under a transformers (or peft) causal LM,
    in fp32: what `forward(sft_datum(tokens), "cross_entropy")` answers as `logprobs`."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
