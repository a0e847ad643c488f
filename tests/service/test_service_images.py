"""The images of a request, checked in the service before anything is queued
(`ember.service.images`): counts, bounds, and `ImageAssetPointerChunk` locations under an
operator's image root only, by every spelling."""

from __future__ import annotations

import os

import pytest
from tinker import types

from ember.service.api import UserError
from ember.service.images import check_request_images
from ember.service.limits import Limits
from helpers.images import hostile_images, image_bytes

from .conftest import new_run, wait

LIMITS = Limits(max_image_bytes=1 << 20, max_image_pixels=1 << 20, max_images_per_request=3)


def _prompt(*chunks) -> types.ModelInput:
    return types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]), *chunks])


def _pointer(location: str) -> types.ImageAssetPointerChunk:
    return types.ImageAssetPointerChunk(location=location, format="png", expected_tokens=4)


@pytest.fixture
def roots(tmp_path):
    """(image root, data dir, a file outside, a symlink out of the root)."""
    root, data, outside = tmp_path / "images", tmp_path / "data", tmp_path / "secret"
    for d in (root, data, outside):
        d.mkdir()
    (root / "sub").mkdir()
    (root / "sub" / "cat.png").write_bytes(image_bytes(color=(0, 0, 255)))
    (outside / "x.png").write_bytes(image_bytes())
    (data / "x.png").write_bytes(image_bytes())
    os.symlink(outside / "x.png", root / "link.png")
    return root, data, outside


def test_a_pointer_under_the_image_root_becomes_the_files_image_chunk(roots):
    root, data, _ = roots
    for location in (str(root / "sub" / "cat.png"), "sub/cat.png", str(root / "sub" / ".." / "sub" / "cat.png")):
        [mi] = check_request_images([("prompt", _prompt(_pointer(location)))], LIMITS, [root], [data])
        chunk = mi.chunks[1]
        assert isinstance(chunk, types.ImageChunk) and chunk.expected_tokens == 4
        assert chunk.data == (root / "sub" / "cat.png").read_bytes()


def test_every_spelling_out_of_the_root_is_refused(roots):
    root, data, outside = roots
    spellings = [str(outside / "x.png"), "../secret/x.png", str(root / ".." / "secret" / "x.png"), "link.png",
                 str(root / "link.png"), f"file://{root}/sub/cat.png", f"file:{root}/sub/cat.png",
                 "http://127.0.0.1:1/cat.png", "https://example.com/cat.png", "data:image/png;base64,AAAA",
                 "sub/missing.png", str(root), "sub\x00/cat.png", ""]
    for location in spellings:
        with pytest.raises(UserError, match=r"^prompt: chunk 1 \(image_asset_pointer\): ") as info:
            check_request_images([("prompt", _prompt(_pointer(location)))], LIMITS, [root], [data])
        assert "location" in str(info.value), (location, str(info.value))
    private_root = [data.parent]  # a root holding the data directory still never reaches it
    with pytest.raises(UserError, match="not a readable file under an image root"):
        check_request_images([("p", _prompt(_pointer(str(data / "x.png"))))], LIMITS, private_root, [data])


def test_no_image_root_refuses_every_pointer(roots):
    root, data, _ = roots
    with pytest.raises(UserError, match="needs the operator's --image-root"):
        check_request_images([("prompt", _prompt(_pointer(str(root / "sub" / "cat.png"))))], LIMITS, [], [data])


def test_counts_bytes_and_hostile_images_are_refused_naming_datum_and_chunk(roots):
    good = types.ImageChunk(data=image_bytes(), format="png")
    four = [(f"datum {i}: model_input", _prompt(good)) for i in range(4)]
    with pytest.raises(UserError, match="4 images; the limit is max_images_per_request=3"):
        check_request_images(four, LIMITS)
    for name, (data, fmt, word) in hostile_images().items():
        bad = types.ImageChunk.model_construct(data=data, format=fmt, expected_tokens=None, type="image")
        with pytest.raises(UserError, match=r"^datum 1: model_input: chunk 2 \(image\): ") as info:
            check_request_images([("datum 0: model_input", _prompt(good)),
                                  ("datum 1: model_input", _prompt(good, bad))], LIMITS)
        assert word in str(info.value), (name, str(info.value))
    with pytest.raises(UserError, match="expected_tokens must be an integer >= 1"):
        check_request_images([("prompt", _prompt(good.model_copy(update={"expected_tokens": -3})))], LIMITS)


def test_the_service_refuses_a_bad_image_as_the_users_error_and_keeps_serving(make_service, roots):
    root, _, _ = roots
    # 600 s: the refused request takes its seq_id's turn; a gap would stall the next one
    svc = make_service(image_roots=[root], seq_gap_timeout_s=600)
    _, run = new_run(svc)
    bomb, _, _ = hostile_images()["bomb_50000x50000"]
    datum = types.Datum(model_input=_prompt(types.ImageChunk(data=bomb, format="png", expected_tokens=4)),
                        loss_fn_inputs={"target_tokens": [0] * 6, "weights": [1.0] * 6})
    state = wait(svc, "alice", svc.forward_backward("alice", run, 1, [datum], "cross_entropy"))
    assert state.category == "user" and "datum 0: model_input: chunk 1 (image):" in state.error, state.error
    pointer = types.Datum(model_input=_prompt(_pointer("sub/cat.png")), loss_fn_inputs=datum.loss_fn_inputs)
    [resolved] = svc.datums_with_images([pointer])  # the pointer is read into the file's image chunk
    assert resolved.model_input.chunks[1].data == (root / "sub" / "cat.png").read_bytes()
    assert resolved.loss_fn_inputs.keys() == datum.loss_fn_inputs.keys()
    text = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                       loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0] * 3})
    assert wait(svc, "alice", svc.forward_backward("alice", run, 2, [text], "cross_entropy")).status == "complete"


def test_a_wrong_expected_tokens_is_refused_when_the_request_arrives(tmp_path):
    """With the model's `VisionSpec`, the count is checked before anything is queued
    (a 56x56 image is 4 tokens on the tiny Qwen3-VL); a right or unset count passes."""
    from ember.models.testing import build_tiny_model
    from ember.service.images import vision_spec_of
    from helpers.vision import png_bytes

    spec = vision_spec_of(str(build_tiny_model(tmp_path / "vl", family="qwen3_vl", seed=0)))
    data = png_bytes((200, 30, 30))
    good = types.ImageChunk(data=data, format="png", expected_tokens=4)
    unset = types.ImageChunk.model_construct(data=data, format="png", expected_tokens=None, type="image")
    check_request_images([("datum 0: model_input", _prompt(good)), ("datum 1: model_input", _prompt(unset))],
                         LIMITS, spec=spec)
    bad = good.model_copy(update={"expected_tokens": 5})
    with pytest.raises(UserError, match=r"^datum 1: model_input chunk 1 \(image\) has expected_tokens=5, but this "
                                        r"model makes 4 tokens of it \(a 56x56 image"):
        check_request_images([("datum 0: model_input", _prompt(good)), ("datum 1: model_input", _prompt(bad))],
                             LIMITS, spec=spec)
    check_request_images([("prompt", _prompt(bad))], LIMITS)  # no model given: the count is the expansion's
