"""Vision-language families (`qwen3_vl`, `qwen2_5_vl`): `ember tiny-model` writes a model
that transformers' own classes load back, and `expand_model_input` turns Tinker image
chunks into what the model consumes, with Tinker's counting."""

from __future__ import annotations

import json

import pytest
import torch
from tinker import types
from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

from ember.cli import main
from ember.models import apply_lora, load_model, load_tokenizer
from ember.models.families import FAMILIES, vision_families
from ember.models.vision import expand_model_input, load_vision_spec
from helpers.vision import COLORS, image_tokens, png_bytes

CLASSES = {"qwen3_vl": Qwen3VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration}


@pytest.fixture(scope="module", params=sorted(CLASSES))
def vl_dir(request, tmp_path_factory):
    """`ember tiny-model --family <vl> DIR` with the defaults (byte tokenizer, head_dim 32)."""
    out = tmp_path_factory.mktemp(request.param) / "m"
    assert main(["tiny-model", str(out), "--family", request.param]) == 0
    return request.param, out


def test_vision_families_are_registered():
    assert set(vision_families()) == set(CLASSES)
    for name in CLASSES:
        assert FAMILIES[name].tp_plan is None and FAMILIES[name].decode is None


def test_tiny_model_loads_through_transformers(vl_dir):
    family, out = vl_dir
    model = CLASSES[family].from_pretrained(out, local_files_only=True)
    assert sum(p.numel() for p in model.model.visual.parameters()) > 0
    tok = load_tokenizer(out)
    config = json.loads((out / "config.json").read_text())
    for key, token in (("image_token_id", "<|image_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
                       ("vision_end_token_id", "<|vision_end|>")):
        assert config[key] == tok.convert_tokens_to_ids(token)
        assert tok.decode([config[key]]) == token  # a single special token
    processor = AutoImageProcessor.from_pretrained(out, local_files_only=True)
    assert type(processor).__name__ == "Qwen2VLImageProcessorPil"  # no torchvision needed
    assert isinstance(load_model(out), CLASSES[family])  # ember's loader picks the family's class


def test_chat_template_renders_image_parts(vl_dir):
    tok = load_tokenizer(vl_dir[1])
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hue?"}]}],
                                   tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hue?<|im_end|>\n<|im_start|>assistant\n"


def _image_input(tok, image: bytes, expected: int | None) -> types.ModelInput:
    start, end = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    return types.ModelInput(chunks=[types.EncodedTextChunk(tokens=tok.encode("a") + [start]),
                                    types.ImageChunk(data=image, format="png", expected_tokens=expected),
                                    types.EncodedTextChunk(tokens=[end] + tok.encode("bc"))])


@pytest.mark.parametrize("size", [56, 112])
def test_expansion_follows_tinker_counting(vl_dir, size):
    """An image chunk is its `expected_tokens` `<|image_pad|>`s: the expanded length is
    `ModelInput.length`, and a forward with the pixels runs."""
    family, out = vl_dir
    tok, spec, model = load_tokenizer(out), load_vision_spec(out), load_model(out)
    n = image_tokens(out, size)
    assert n == (4 if size == 56 else 16)
    mi = _image_input(tok, png_bytes(COLORS["red"], size), n)
    ex = expand_model_input(mi, spec, where="datum 0")
    assert ex.input_ids.shape[0] == mi.length == 2 + n + 3
    assert (ex.input_ids == spec.image_token_id).sum() == n and ex.mm_token_type_ids.sum() == n
    assert ex.image_grid_thw.tolist() == [[1, 2 * int(n ** 0.5), 2 * int(n ** 0.5)]]
    with torch.no_grad():
        logits = model(input_ids=ex.input_ids[None], **ex.model_kwargs()).logits
    assert logits.shape[:2] == (1, mi.length) and torch.isfinite(logits).all()


def test_expansion_without_expected_tokens_uses_the_models_count(vl_dir):
    tok, spec = load_tokenizer(vl_dir[1]), load_vision_spec(vl_dir[1])
    ex = expand_model_input(_image_input(tok, png_bytes(COLORS["blue"]), None), spec, where="datum 0")
    assert ex.num_images == 1 and ex.input_ids.shape[0] == 2 + 4 + 3


def test_wrong_expected_tokens_is_refused_naming_chunk_and_counts(vl_dir):
    tok, spec = load_tokenizer(vl_dir[1]), load_vision_spec(vl_dir[1])
    with pytest.raises(ValueError) as err:
        expand_model_input(_image_input(tok, png_bytes(COLORS["blue"]), 5), spec, where="datum 3")
    msg = str(err.value)
    assert msg.startswith("datum 3: model_input chunk 1 (image) has expected_tokens=5, but this model makes 4 tokens")
    assert "56x56" in msg


def test_the_count_from_a_size_is_the_count_from_the_pixels(vl_dir):
    """What admission checks before decoding (`token_count_of_size`, from the header's
    size) is what the expansion makes of the pixels, for square, wide, tall, tiny and
    large images (each family's processor resizes its own way)."""
    from PIL import Image

    spec = load_vision_spec(vl_dir[1])
    for width, height in [(56, 56), (57, 113), (300, 20), (20, 300), (1, 1), (1000, 700), (2048, 4096)]:
        _, grid = spec.encode(Image.new("RGB", (width, height)))
        assert spec.token_count_of_size(width, height) == spec.token_count(grid), (width, height)


def test_decoded_images_are_taken_as_given(vl_dir):
    """The sampler and the HTTP routes hand over images decoded (and bounded) already."""
    from PIL import Image

    tok, spec = load_tokenizer(vl_dir[1]), load_vision_spec(vl_dir[1])
    mi = _image_input(tok, b"not decoded here", 4)
    given = expand_model_input(mi, spec, where="prompt", images=[Image.new("RGB", (56, 56), COLORS["red"])])
    decoded = expand_model_input(_image_input(tok, png_bytes(COLORS["red"]), 4), spec, where="prompt")
    assert torch.equal(given.input_ids, decoded.input_ids) and torch.equal(given.pixel_values, decoded.pixel_values)
    with pytest.raises(ValueError, match="1 image chunks but 0 decoded images"):
        expand_model_input(mi, spec, where="prompt", images=[])


def test_corrupt_image_bytes_name_the_chunk(vl_dir):
    tok, spec = load_tokenizer(vl_dir[1]), load_vision_spec(vl_dir[1])
    with pytest.raises(ValueError, match=r"^datum 2: model_input chunk 1 \(png image\) cannot be decoded"):
        expand_model_input(_image_input(tok, b"\x89PNG garbage", 4), spec, where="datum 2")


def test_lora_targets_the_language_model_only(vl_dir):
    """Qwen2.5-VL's tower names its MLP like the decoder's (gate/up/down_proj): the adapter
    still goes on the language model only."""
    model = apply_lora(load_model(vl_dir[1]), types.LoraConfig(rank=2))
    lora = [n for n, _ in model.named_parameters() if "lora_A" in n]
    assert lora and all("language_model" in n or ".lm_head." in n for n in lora)
    assert any(".mlp.gate_proj." in n for n in lora) and not [n for n in lora if "visual" in n]


def test_tiny_config_of_a_vision_family_needs_the_placeholder_ids():
    from ember.models.testing import tiny_config

    with pytest.raises(ValueError, match="'qwen3_vl' takes images: pass vision_token_ids"):
        tiny_config("qwen3_vl", vocab_size=50)
    ids = {"image_token_id": 40, "video_token_id": 41, "vision_start_token_id": 42, "vision_end_token_id": 43}
    config = tiny_config("qwen3_vl", vocab_size=50, vision_token_ids=ids)
    assert config.model_type == "qwen3_vl" and config.image_token_id == 40
    assert sum(config.text_config.rope_parameters["mrope_section"]) == config.text_config.head_dim // 2
