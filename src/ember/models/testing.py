"""Tiny models and tokenizers built in code, for tests, benchmarks and the demo.

Nothing here downloads anything: a tokenizer is trained with the `tokenizers` library on
a small corpus, a model is built from a transformers config with random weights, both
are saved to a directory and are meant to be loaded back through the real
`from_pretrained` path (`ember.models.load_model` / `load_tokenizer`).
"""

from __future__ import annotations

import os
import string
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from ember.models.families import FAMILIES, TinyChat, VisionFamily
from ember.models.loading import model_class

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
    extra_special: Sequence[str] = (),
) -> PreTrainedTokenizerFast:
    """Train a BPE tokenizer in code and save it (with EOS, PAD and a chat template).

    With `vocab_size=None` no merges are learned: one token per character of `alphabet`,
    which is what small arithmetic tasks want. Pass a corpus and a larger `vocab_size`
    for a tokenizer with merges. `extra_special` (a vision model's placeholder tokens) are
    more single special tokens, after the others; the chat template then renders image
    content parts as the vision placeholder (`VISION_CHAT_TEMPLATE`).
    """
    chars = sorted(set(alphabet))
    special = SPECIAL_TOKENS + list(extra_special)
    size = vocab_size or (len(chars) + len(special))
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.decoder = decoders.Fuse()  # concatenate pieces; no spaces invented between chars
    trainer = trainers.BpeTrainer(
        vocab_size=size, special_tokens=special, initial_alphabet=chars, show_progress=False
    )
    tok.train_from_iterator(corpus or [alphabet], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT, *extra_special],
    )
    fast.chat_template = vision_chat_template("<|' + message['role'] + '|>", "<|eos|>", "<|assistant|>") \
        if extra_special else CHAT_TEMPLATE
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


# The byte-level tokenizer of `ember tiny-model`: every byte is a token, so any text
# round-trips (`\\ { } < > | _ [ ] #`, any unicode), plus the chat markers the common
# chat formats (and tinker-cookbook's renderers: role_colon, qwen3, llama3) expect to be
# single tokens. ChatML (Qwen) markers first: EOS ends an assistant turn, as in Qwen3.
BYTE_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",                          # ChatML / Qwen
    "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",  # Llama 3
]
# Qwen3 keeps these as added (not special) tokens: text markers the model emits itself.
BYTE_ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def vision_chat_template(open_turn: str, close_turn: str, generation_prompt: str) -> str:
    """A chat template whose message content may also be a list of parts (OpenAI's and
    transformers' shape): text parts as their text, image parts (`image`, `image_url`) as
    Qwen-VL's placeholder `<|vision_start|><|image_pad|><|vision_end|>`, which
    `ember.models.vision` expands to one `<|image_pad|>` per merged patch."""
    part = ("{% if part is string %}{{ part }}{% elif part['type'] in ('image', 'image_url') %}"
            "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% else %}{{ part['text'] }}{% endif %}")
    return ("{% for message in messages %}{{ '" + open_turn + "' }}"
            "{% if message['content'] is string %}{{ message['content'] }}"
            "{% else %}{% for part in message['content'] %}" + part + "{% endfor %}{% endif %}"
            "{{ '" + close_turn + "' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '" + generation_prompt + "' }}{% endif %}")


def build_byte_tokenizer(
    out_dir: str | os.PathLike, corpus: list[str] | None = None, merges: int = 0,
    extra_special: Sequence[str] = (), chat: TinyChat | None = None,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer in code and save it (ChatML template, EOS `<|im_end|>`).

    The 256 byte symbols are the initial alphabet, so every byte sequence encodes and
    decodes back exactly; with `merges=0` (the default) no merges are learned (one token
    per byte). `BYTE_SPECIAL_TOKENS` are single tokens; there is no BOS (as in Qwen3).
    `extra_special` as in `build_tokenizer` (a vision model's placeholder tokens). `chat`
    (a family's `TinyChat`, e.g. gpt-oss's harmony) replaces ChatML: its special tokens,
    EOS and template.
    """
    if chat is not None:
        return _save_chat_tokenizer(out_dir, corpus, merges, chat)
    special = BYTE_SPECIAL_TOKENS + list(extra_special)
    fast = PreTrainedTokenizerFast(tokenizer_object=_byte_bpe(corpus, merges, special), eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=special[1:])
    fast.add_tokens(BYTE_ADDED_TOKENS)
    fast.chat_template = vision_chat_template("<|im_start|>' + message['role'] + '\\n", "<|im_end|>\\n",
                                              "<|im_start|>assistant\\n") if extra_special else CHATML_TEMPLATE
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def _byte_bpe(corpus: list[str] | None, merges: int, special: list[str]) -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=len(special) + len(alphabet) + merges, special_tokens=special,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(corpus or [], trainer=trainer)
    return tok


def _save_chat_tokenizer(out_dir: str | os.PathLike, corpus: list[str] | None, merges: int,
                         chat: TinyChat) -> PreTrainedTokenizerFast:
    """The byte-level tokenizer with a family's own chat markers (`TinyChat`): the first is the pad."""
    special = list(chat.special)
    fast = PreTrainedTokenizerFast(tokenizer_object=_byte_bpe(corpus, merges, special), eos_token=chat.eos,
                                   pad_token=special[0], additional_special_tokens=special[1:])
    fast.chat_template = chat.template
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


TOKENIZERS = {"chars": "one token per character of an alphabet (`build_tokenizer`)",
              "bytes": "byte-level, every byte a token, chat markers (`build_byte_tokenizer`)"}


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
    vision_token_ids: dict[str, int] | None = None,
    tie_word_embeddings: bool = False,
):
    """A transformers config for a tiny model of `family` (a key of `FAMILIES`; each family
    file's `tiny_config` builds it), head_dim always explicit. A vision-language family
    needs `vision_token_ids` (its config's `image_token_id`, ... from the tokenizer).
    `tie_word_embeddings`: lm_head shares the input embedding (untied by default)."""
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; expected one of {sorted(FAMILIES)}")
    if FAMILIES[family].vision is not None:
        if vision_token_ids is None:
            raise ValueError(f"tiny model family {family!r} takes images: pass vision_token_ids (the tokenizer's "
                             "image_token_id, video_token_id, vision_start_token_id, vision_end_token_id)")
        kwargs["vision_token_ids"] = vision_token_ids
    return FAMILIES[family].tiny_config(**kwargs)


def _vision_token_ids(tok: PreTrainedTokenizerFast, vision: VisionFamily) -> dict[str, int]:
    ids = tok.convert_tokens_to_ids
    return {"image_token_id": ids(vision.image_token), "video_token_id": ids(vision.video_token),
            "vision_start_token_id": ids(vision.start_token), "vision_end_token_id": ids(vision.end_token)}


# The tiny image processor: images scaled to between 32x32 and 512x512 pixels (a 56x56 image
# stays 4 merged tokens; the 448x448 benchmark image 196 or 256), CLIP normalisation.
TINY_MIN_PIXELS = 32 * 32
TINY_MAX_PIXELS = 512 * 512


def build_image_processor(patch_size: int):
    """The PIL image processor of a tiny Qwen-VL model (no torchvision needed), `patch_size`
    the tower's, 2x2 merge, 2-frame temporal patches (a still image is repeated)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=patch_size, merge_size=2, temporal_patch_size=2,
                                    size={"shortest_edge": TINY_MIN_PIXELS, "longest_edge": TINY_MAX_PIXELS})


def build_tiny_model(
    out_dir: str | os.PathLike,
    family: str = "qwen3",
    seed: int = 0,
    tokenizer_alphabet: str = DEFAULT_ALPHABET,
    tokenizer: str = "chars",
    **config_kwargs,
) -> Path:
    """Build a tokenizer and a random-weight model in `out_dir`; return the directory.

    `tokenizer` is a key of `TOKENIZERS`: "chars" (the default: tests and the demo are
    calibrated on it) uses `tokenizer_alphabet`; "bytes" is `ember tiny-model`'s.
    A vision-language family (`qwen3_vl`, `qwen2_5_vl`) adds its placeholder tokens to the
    tokenizer, a tiny vision tower to the model and a PIL image processor config
    (`build_image_processor`); a family with its own chat markers (`ModelFamily.tiny_chat`:
    gpt-oss's harmony) gets them in the "bytes" tokenizer.
    Load it back with `ember.models.load_model(out_dir)` / `load_tokenizer(out_dir)`.
    """
    out = Path(out_dir)
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; expected one of {', '.join(TOKENIZERS)}")
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; expected one of {sorted(FAMILIES)}")
    vision = FAMILIES[family].vision
    extra = vision.special_tokens if vision is not None else ()
    chat = FAMILIES[family].tiny_chat
    tok = build_byte_tokenizer(out, extra_special=extra, chat=chat) if tokenizer == "bytes" else \
        build_tokenizer(out, alphabet=tokenizer_alphabet, extra_special=extra)
    if vision is not None:
        config_kwargs["vision_token_ids"] = _vision_token_ids(tok, vision)
        build_image_processor(vision.tiny_patch_size).save_pretrained(out)
    cfg = tiny_config(
        family, vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        **config_kwargs,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32) if vision is None else \
            model_class(cfg)(cfg).to(torch.float32)
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
