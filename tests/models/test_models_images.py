"""The bounded image decoder (`ember.models.images`): every hostile image is an
`ImageError` naming where, refused before it is decoded when its header is too big."""

from __future__ import annotations

import pytest
from PIL import Image

from ember.models.images import ImageBounds, ImageError, decode_image, image_digest, probe_image
from helpers.images import hostile_images, image_bytes, png_claiming

BOUNDS = ImageBounds(max_bytes=1 << 20, max_pixels=1 << 20)


@pytest.mark.parametrize("fmt", ["png", "jpeg"])
def test_a_good_image_decodes_to_rgb(fmt):
    img = decode_image(image_bytes(64, 32, fmt=fmt), fmt, BOUNDS, "datum 0: chunk 1")
    assert img.mode == "RGB" and img.size == (64, 32)


@pytest.mark.parametrize("name", sorted(hostile_images()))
def test_each_hostile_image_is_refused_naming_the_chunk(name):
    data, fmt, word = hostile_images()[name]
    with pytest.raises(ImageError) as info:
        decode_image(data, fmt, BOUNDS, "datum 3: chunk 2")
    assert str(info.value).startswith("datum 3: chunk 2:") and word in str(info.value), str(info.value)


def test_a_bomb_is_refused_from_its_header_without_decoding():
    """50,000 x 50,000 RGB would be 7.5 GB: refused from the header (past PIL's own bomb bound
    too, which is caught and never changed), as is a modest 2000 x 1000 over our bound."""
    bomb = png_claiming(50_000, 50_000)
    assert len(bomb) < 1000
    with pytest.raises(ImageError, match="pixels"):
        probe_image(bomb, "png", ImageBounds(max_pixels=4 * 10**9), "prompt: chunk 0")  # PIL's own bound
    with pytest.raises(ImageError, match="max_image_pixels=1048576"):
        probe_image(png_claiming(2000, 1000), "png", BOUNDS, "prompt: chunk 0")
    assert Image.MAX_IMAGE_PIXELS == 89478485  # never mutated


def test_the_byte_bound_is_checked_before_the_header():
    data = image_bytes(64, 64)
    with pytest.raises(ImageError, match=f"{len(data)} bytes; the limit is max_image_bytes=100"):
        probe_image(data, "png", ImageBounds(max_bytes=100), "datum 0: chunk 0")


def test_digest_tells_images_apart():
    a, b = image_bytes(color=(1, 2, 3)), image_bytes(color=(1, 2, 4))
    assert image_digest(a) == image_digest(bytes(a)) != image_digest(b)
