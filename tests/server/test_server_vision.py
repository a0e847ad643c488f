"""Images over HTTP (issue 27): the unmodified official SDK against `ember serve` on a tiny
Qwen3-VL, with an operator's `--image-root` and the server's address space capped (it is
sent hostile images).

* a datum with an `ImageChunk` trains (protobuf forward_backward): its loss falls;
* `sample` with an image prompt: sampled-token logprobs and `compute_logprobs` equal the
  trainer's `forward` (contract 5, 1e-4);
* tinker-cookbook's own Qwen3-VL renderer and `image_to_chunk` build the inputs;
* a wrong `expected_tokens` is a user error naming the chunk;
* an `ImageAssetPointerChunk` under `--image-root` works; every spelling out of it is refused;
* hostile images (bombs, corrupt, mislabelled, empty, too many) are refused naming the
  chunk, over JSON (sample) and protobuf (forward), and the server keeps serving;
* the OpenAI chat route takes `data:` image URLs only.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from ember.models.testing import build_tiny_model
from ember.models.vision import load_vision_spec
from helpers.images import hostile_images
from helpers.server import API_KEY, MODEL_NAME, memory_cap, start_server
from helpers.vision import COLORS, image_datum, image_tokens, png_bytes

# `slow`: left out of `make test-fast` (see README, "Developing: the tests"); ~100 s with its server.
pytestmark = pytest.mark.slow

MEMORY_CAP_BYTES = 4 * 1024**3  # a decoded 50,000 x 50,000 bomb (7.5 GB) could not fit
ADAM = types.AdamParams(learning_rate=2e-2)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("qwen3-vl"), family="qwen3_vl")


@pytest.fixture(scope="module")
def image_root(tmp_path_factory) -> Path:
    """The operator's image root (a red square in a subdirectory, a symlink pointing out),
    and beside it a directory the root does not cover."""
    base = tmp_path_factory.mktemp("images")
    root, outside = base / "root", base / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (root / "sub" / "red.png").write_bytes(png_bytes(COLORS["red"]))
    (outside / "secret.png").write_bytes(png_bytes(COLORS["blue"]))
    os.symlink(outside / "secret.png", root / "link.png")
    return root


@pytest.fixture(scope="module")
def server(vl_dir, image_root, tmp_path_factory):
    proc = start_server(vl_dir, tmp_path_factory.mktemp("serve-vl"), wrap=memory_cap(MEMORY_CAP_BYTES),
                        extra_args=["--image-root", str(image_root), "--limits.max_images_per_request", "8",
                                    "--limits.max_image_pixels", "4000000"])
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def sc(server):
    client = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    yield client
    client.close("success").result(timeout=60)


@pytest.fixture(scope="module")
def tc(sc):
    return sc.create_lora_training_client(base_model=MODEL_NAME, rank=8).result(timeout=300)


@pytest.fixture(scope="module")
def tok(vl_dir):
    from ember.models import load_tokenizer

    return load_tokenizer(vl_dir)


@pytest.fixture(scope="module")
def n_image(vl_dir) -> int:
    return image_tokens(vl_dir, 56)


def _prompt(tok, image_chunk) -> types.ModelInput:
    start, end = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    return types.ModelInput(chunks=[types.EncodedTextChunk(tokens=tok.encode("colour: ") + [start]), image_chunk,
                                    types.EncodedTextChunk(tokens=[end] + tok.encode(" is"))])


def _image(data: bytes, n: int | None, fmt: str = "png") -> types.ImageChunk:
    return types.ImageChunk.model_construct(data=data, format=fmt, expected_tokens=n, type="image")


def _forward_logprobs(tc, prompt: types.ModelInput, completion: list[int]) -> np.ndarray:
    """The trainer's logprobs of each completion token after `prompt` (one forward)."""
    chunks = list(prompt.chunks) + [types.EncodedTextChunk(tokens=completion[:-1])]
    n = prompt.length
    targets = [0] * (n - 1) + list(completion)
    datum = types.Datum(model_input=types.ModelInput(chunks=chunks),
                        loss_fn_inputs={"target_tokens": np.array(targets, dtype=np.int64)})
    out = tc.forward([datum], "cross_entropy").result(timeout=300)
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].data)[n - 1:]


def test_an_image_datum_trains_and_its_loss_falls(tc, tok, n_image):
    datum = image_datum(tok, png_bytes(COLORS["red"]), "colour:", " red", n_image)
    losses = []
    for _ in range(4):
        fb = tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(ADAM).result(timeout=300)
        losses.append(fb.result(timeout=300).metrics["loss:sum"])
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.85 * losses[0], losses


def test_sampled_logprobs_and_compute_logprobs_equal_forward(tc, tok, vl_dir, n_image):
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = _prompt(tok, _image(png_bytes(COLORS["green"]), n_image))
    stop = [load_vision_spec(vl_dir).image_token_id, tok.eos_token_id]  # a drawn placeholder ends it (last token)
    r = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=stop)).result()
    seq = r.sequences[0]
    np.testing.assert_allclose(seq.logprobs, _forward_logprobs(tc, prompt, seq.tokens), atol=1e-4)
    # the completion but its last token (which may be a drawn placeholder: not allowed in text)
    full = types.ModelInput(chunks=list(prompt.chunks) + [types.EncodedTextChunk(tokens=seq.tokens[:-1])])
    scored = sampler.compute_logprobs(full).result()
    np.testing.assert_allclose(scored[prompt.length:], _forward_logprobs(tc, prompt, seq.tokens)[:-1], atol=1e-4)


def test_tinker_cookbook_renderer_and_image_to_chunk_build_the_inputs(tc, tok, vl_dir, n_image):
    pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is not installed (`make test` installs it)")
    from PIL import Image
    from tinker_cookbook.renderers.qwen3 import Qwen3VLInstructRenderer
    from tinker_cookbook.supervised.common import datum_from_model_input_weights

    renderer = Qwen3VLInstructRenderer(tok, load_vision_spec(vl_dir).processor)
    image = Image.new("RGB", (56, 56), COLORS["yellow"])
    convo = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "colour?"}]},
             {"role": "assistant", "content": "yellow"}]
    model_input, weights = renderer.build_supervised_example(convo)
    images = [c for c in model_input.chunks if isinstance(c, types.ImageChunk)]
    assert len(images) == 1 and images[0].format == "jpeg" and images[0].expected_tokens == n_image
    datum = datum_from_model_input_weights(model_input, weights)
    fb = tc.forward_backward([datum], "cross_entropy").result(timeout=300)
    assert np.isfinite(fb.metrics["loss:sum"]) and fb.metrics["loss:sum"] > 0
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = renderer.build_generation_prompt(convo[:1])
    scored = sampler.compute_logprobs(prompt).result()
    assert len(scored) == prompt.length and all(np.isfinite(scored[1:]))


def test_a_wrong_expected_tokens_is_a_user_error_naming_the_chunk(tc, tok, n_image):
    datum = image_datum(tok, png_bytes(COLORS["red"]), "colour:", " red", n_image + 3)
    with pytest.raises(tinker.RequestFailedError) as info:
        tc.forward([datum], "cross_entropy").result(timeout=300)
    text = str(info.value)
    assert "chunk 1" in text and f"expected_tokens={n_image + 3}" in text and str(n_image) in text, text
    sampler = tc.save_weights_and_get_sampling_client()
    with pytest.raises(tinker.RequestFailedError) as info:
        sampler.sample(_prompt(tok, _image(png_bytes(COLORS["red"]), n_image + 3)), 1,
                       types.SamplingParams(max_tokens=1)).result()
    assert "chunk 1" in str(info.value) and f"expected_tokens={n_image + 3}" in str(info.value), str(info.value)


def test_image_pointers_under_the_root_only(tc, tok, image_root, n_image):
    sampler = tc.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=1, temperature=0.0)

    def pointer(location):
        return types.ImageAssetPointerChunk(location=location, format="png", expected_tokens=n_image)

    by_pointer = sampler.compute_logprobs(_prompt(tok, pointer("sub/red.png"))).result()
    by_bytes = sampler.compute_logprobs(_prompt(tok, _image((image_root / "sub" / "red.png").read_bytes(), n_image)))
    np.testing.assert_allclose(by_pointer[1:], by_bytes.result()[1:], atol=1e-6)
    assert sampler.sample(_prompt(tok, pointer(str(image_root / "sub" / "red.png"))), 1, params).result().sequences
    outside = image_root.parent / "outside" / "secret.png"
    for location in [str(outside), "../outside/secret.png", f"{image_root}/../outside/secret.png", "link.png",
                     f"file://{image_root}/sub/red.png", "http://127.0.0.1:9/red.png", "https://example.com/x.png",
                     "data:image/png;base64,AAAA", "sub/none.png", "/etc/passwd"]:
        with pytest.raises(tinker.RequestFailedError) as info:
            sampler.sample(_prompt(tok, pointer(location)), 1, params).result()
        assert "chunk 1 (image_asset_pointer)" in str(info.value) and "location" in str(info.value), \
            (location, str(info.value))


def test_hostile_images_are_refused_and_the_server_keeps_serving(server, tc, tok, n_image):
    sampler = tc.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=1)
    for name, (data, fmt, word) in hostile_images().items():
        with pytest.raises(tinker.RequestFailedError) as info:  # JSON (base64) sample
            sampler.sample(_prompt(tok, _image(data, n_image, fmt)), 1, params).result()
        assert "prompt: chunk 1 (image)" in str(info.value) and word in str(info.value), (name, str(info.value))
    bomb, _, _ = hostile_images()["bomb_50000x50000"]
    datum = image_datum(tok, png_bytes(COLORS["red"]), "colour:", " red", n_image)
    bad = types.Datum(model_input=_prompt(tok, _image(bomb, n_image)), loss_fn_inputs=datum.loss_fn_inputs)
    with pytest.raises(tinker.RequestFailedError) as info:  # protobuf forward
        tc.forward([datum, bad], "cross_entropy").result(timeout=300)
    assert "datum 1: model_input: chunk 1 (image)" in str(info.value), str(info.value)
    many = types.ModelInput(chunks=[_image(png_bytes(COLORS["red"]), n_image)] * 9)
    with pytest.raises(tinker.RequestFailedError, match="max_images_per_request=8"):
        sampler.sample(many, 1, params).result()
    assert httpx.get(server.base_url + "/api/v1/healthz", timeout=10).status_code == 200
    assert np.isfinite(tc.forward([datum], "cross_entropy").result(timeout=300).metrics["loss:sum"])
    assert server.proc.poll() is None


def test_openai_chat_takes_data_urls_only(server):
    url = "data:image/png;base64," + base64.b64encode(png_bytes(COLORS["red"])).decode()
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def chat(image_url: str) -> httpx.Response:
        content = [{"type": "text", "text": "colour?"}, {"type": "image_url", "image_url": {"url": image_url}}]
        body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
        return httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=headers, timeout=120)

    ok = chat(url)
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
    for refused in ("https://example.com/cat.png", "file:///etc/passwd", "data:text/plain;base64,aGk="):
        r = chat(refused)
        assert r.status_code == 400 and "image_url.url" in r.text and "never fetches" in r.text, r.text
