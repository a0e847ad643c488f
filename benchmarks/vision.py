"""The vision tower's cost: one 448x448 image per datum vs text of the same expanded length.

A tiny Qwen3-VL (decoder hidden 256, 4 layers; the family's tiny 2-block vision tower)
built in code. Each image datum is `8 text tokens, <|vision_start|>, a 448x448 PNG (196
tokens after the 2x2 merge), <|vision_end|>, 8 text tokens`; its text twin has exactly as
many token positions, all text. In one run, interleaved:

* training: `TorchEngine.forward_backward` on 8 datums (LoRA, tower frozen: the default);
  the image side includes decoding the PNGs, the image processor and the tower;
* sampling: `TorchSampler` on 8 prompts, 16 greedy new tokens each (stop=[]: all 16),
  prefix cache off (so the text prompts get no hits the image ones could not).

Throughput counts expanded positions (prompt + new tokens) per second. The last line is
`image_vs_text_train=<x> image_vs_text_sample=<y>` (image throughput / text throughput:
below 1 is what the images cost).
"""

from __future__ import annotations

import io
import os
import tempfile

import torch
from _common import time_interleaved
from PIL import Image
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.models.testing import build_tiny_model
from ember.sampling import SamplerConfig, TorchSampler

N = 8
SIZE = 448
NEW_TOKENS = 16


def _png(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(SIZE // 16, SIZE // 16, 3, generator=g) * 255).to(torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).resize((SIZE, SIZE), Image.NEAREST).save(buf, format="PNG")
    return buf.getvalue()


def _inputs(tok, n_image: int, g: torch.Generator) -> tuple[list[types.ModelInput], list[types.ModelInput]]:
    """(image prompts, their text twins of equal length)."""
    start, end = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    low = max(tok.all_special_ids) + 1  # plain tokens only: no placeholder in text
    images, texts = [], []
    for i in range(N):
        head = torch.randint(low, len(tok), (8,), generator=g).tolist() + [start]
        tail = [end] + torch.randint(low, len(tok), (8,), generator=g).tolist()
        images.append(types.ModelInput(chunks=[
            types.EncodedTextChunk(tokens=head),
            types.ImageChunk(data=_png(i), format="png", expected_tokens=n_image),
            types.EncodedTextChunk(tokens=tail)]))
        texts.append(types.ModelInput.from_ints(
            head + torch.randint(low, len(tok), (n_image,), generator=g).tolist() + tail))
    return images, texts


def _datum(model_input: types.ModelInput, g: torch.Generator, vocab_low: int, vocab: int) -> types.Datum:
    n = model_input.length
    return types.Datum(model_input=model_input, loss_fn_inputs={
        "target_tokens": torch.randint(vocab_low, vocab, (n,), generator=g),
        "weights": torch.ones(n)})


def main() -> None:
    torch.set_num_threads(int(os.environ.get("EMBER_BENCH_THREADS", "1")))
    g = torch.Generator().manual_seed(0)
    model_dir = build_tiny_model(tempfile.mkdtemp(prefix="ember-bench-vl-"), family="qwen3_vl", hidden_size=256,
                                 num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32)
    from ember.models import load_tokenizer
    from ember.models.vision import load_vision_spec

    tok = load_tokenizer(model_dir)
    proc = load_vision_spec(model_dir).processor
    n_image = proc.get_number_of_image_patches(SIZE, SIZE, images_kwargs={}) // proc.merge_size ** 2
    images, texts = _inputs(tok, n_image, g)
    low = max(tok.all_special_ids) + 1
    positions = sum(mi.length for mi in images)

    engine = TorchEngine.from_pretrained(model_dir, EngineConfig(), lora_config=types.LoraConfig(rank=16))
    train = {name: [_datum(mi, g, low, len(tok)) for mi in batch] for name, batch in
             (("image", images), ("text", texts))}

    def fb(name):
        return lambda: (engine.forward_backward(train[name], "cross_entropy"), engine.clear_gradients())

    t_train = time_interleaved({"image": fb("image"), "text": fb("text")}, repeats=3, warmup=1)

    sampler = TorchSampler.from_pretrained(model_dir, SamplerConfig(prefix_cache_tokens=0))
    params = types.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, stop=[])

    def sample(batch):
        from ember.sampling.base import SamplingRequest

        return lambda: sampler.sample_many([SamplingRequest(prompt=mi, sampling_params=params) for mi in batch])

    t_sample = time_interleaved({"image": sample(images), "text": sample(texts)}, repeats=3, warmup=1)
    sampler.close()

    sampled = positions + N * NEW_TOKENS
    print(f"{N} datums of {images[0].length} positions ({n_image} image tokens from a {SIZE}x{SIZE} PNG each)")
    for name in ("image", "text"):
        print(f"{name}: forward_backward {positions / t_train[name]:,.0f} positions/s; "
              f"sampling {sampled / t_sample[name]:,.0f} positions/s ({NEW_TOKENS} new tokens per prompt)")
    print(f"image_vs_text_train={t_train['text'] / t_train['image']:.3f} "
          f"image_vs_text_sample={t_sample['text'] / t_sample['image']:.3f}")


if __name__ == "__main__":
    main()
