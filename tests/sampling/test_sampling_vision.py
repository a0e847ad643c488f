"""TorchSampler with image prompts on a tiny Qwen3-VL (sampling/vision.py): contract 5
against the model's own full forward, the prefix cache keyed by image bytes, and refusals."""

from __future__ import annotations

import pytest
import torch
from tinker import types

from ember.models.testing import build_tiny_model
from ember.models.vision import expand_model_input
from ember.sampling import SamplerConfig, TorchSampler
from helpers.images import image_bytes

RED, BLUE = image_bytes(56, 56, (220, 20, 20)), image_bytes(56, 56, (20, 20, 220))


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("qwen3_vl"), family="qwen3_vl")


@pytest.fixture(scope="module")
def sampler(vl_dir):
    with TorchSampler.from_pretrained(vl_dir, SamplerConfig(prefix_cache_tokens=1024, prefix_cache_block=4)) as s:
        yield s


def _prompt(image: bytes, before=tuple(range(20, 28)), after=(30, 31, 32), expected=4) -> types.ModelInput:
    return types.ModelInput(chunks=[types.EncodedTextChunk(tokens=list(before)),
                                    types.ImageChunk(data=image, format="png", expected_tokens=expected),
                                    types.EncodedTextChunk(tokens=list(after))])


def _params(sampler, **kwargs) -> types.SamplingParams:
    """Sampling that stops at a placeholder token (the random model may draw one): the
    reference forward below then never sees one outside an image (transformers would
    count it as the image's)."""
    stop = [sampler.vision.image_token_id, *sampler.eos_token_ids]
    return types.SamplingParams(stop=stop, **kwargs)


def _reference(sampler, prompt: types.ModelInput, completion: list[int]) -> torch.Tensor:
    """log p of every position of prompt + completion from one plain transformers forward
    (the last completion token is only a target)."""
    ex = expand_model_input(prompt, sampler.vision, "prompt")
    targets = torch.cat([ex.input_ids, torch.tensor(completion, dtype=torch.int64)])
    ids = targets[:-1]
    mm = torch.cat([ex.mm_token_type_ids, torch.zeros(len(completion), dtype=torch.int32)])[:-1]
    with torch.no_grad():
        logits = sampler.model(input_ids=ids[None], pixel_values=ex.pixel_values, image_grid_thw=ex.image_grid_thw,
                               mm_token_type_ids=mm[None]).logits[0]
    lp = torch.log_softmax(logits.float(), -1)
    return lp[torch.arange(len(ids)), targets[1:]]


def test_sample_and_compute_logprobs_equal_the_full_forward(sampler):
    prompt = _prompt(RED)
    r = sampler.sample(prompt, 2, _params(sampler, max_tokens=6, temperature=1.0, seed=1),
                       include_prompt_logprobs=True)
    n = prompt.length
    for seq in r.sequences:
        ref = _reference(sampler, prompt, seq.tokens)
        assert torch.allclose(torch.tensor(seq.logprobs), ref[n - 1:], atol=1e-4), (seq.logprobs, ref[n - 1:])
    ref = _reference(sampler, prompt, [])
    for got in (r.prompt_logprobs, sampler.compute_logprobs(prompt)):
        assert len(got) == n and got[0] is None
        assert torch.allclose(torch.tensor(got[1:]), ref, atol=1e-4)


def test_the_prefix_cache_keys_images_by_their_bytes(sampler):
    params = _params(sampler, max_tokens=3, temperature=0.0)
    sampler.prefix_cache.clear()
    red = sampler.sample(_prompt(RED, after=tuple(range(30, 42))), 1, params)
    again = sampler.sample(_prompt(RED, after=tuple(range(30, 42))), 1, params)
    blue = sampler.sample(_prompt(BLUE, after=tuple(range(30, 42))), 1, params)
    assert red.prompt_cache_hit_tokens in (None, 0)
    assert again.prompt_cache_hit_tokens >= 12 and again.sequences[0].tokens == red.sequences[0].tokens
    # the blue image shares only the text before it (8 tokens), never the red image's KV
    assert blue.prompt_cache_hit_tokens == 8
    ref = _reference(sampler, _prompt(BLUE, after=tuple(range(30, 42))), blue.sequences[0].tokens)
    assert torch.allclose(torch.tensor(blue.sequences[0].logprobs), ref[-len(blue.sequences[0].tokens):], atol=1e-4)


def test_a_wrong_expected_tokens_names_the_chunk(sampler):
    with pytest.raises(ValueError, match=r"prompt: model_input chunk 1 \(image\) has expected_tokens=5, but this "
                                         r"model makes 4"):
        sampler.sample(_prompt(RED, expected=5), 1, types.SamplingParams(max_tokens=1))


def test_a_placeholder_token_in_text_is_refused(sampler):
    with pytest.raises(ValueError, match=r"prompt: chunk 0 \(encoded_text\) holds the image placeholder token"):
        sampler.sample(_prompt(RED, before=(20, sampler.vision.image_token_id)), 1, types.SamplingParams(max_tokens=1))


def test_the_vllm_backend_refuses_a_vision_model_with_its_reason(vl_dir):
    from ember.sampling.base import UnsupportedModelError
    from ember.sampling.vllm_support import check_vllm_model

    for device in ("cpu", "cuda"):
        with pytest.raises(UnsupportedModelError, match="vision_config: the vLLM sampler backend does not serve "
                                                        "vision-language models.*--sampler.backend torch"):
            check_vllm_model(vl_dir, device)  # (text models: tests/sampling/test_sampling_backend_support.py)


def test_a_text_model_refuses_an_image_prompt(tiny_model_dir):
    with TorchSampler.from_pretrained(tiny_model_dir) as text:
        with pytest.raises(ValueError, match="prompt: chunk 1 is an image, but this model takes text only"):
            text.sample(_prompt(RED), 1, types.SamplingParams(max_tokens=1))
