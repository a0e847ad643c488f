"""Untrusted image bytes -> a decoded RGB picture, bounded before anything is decoded.

The one home of image decoding (docs/architecture.md, "Trust boundaries"). An image chunk
is attacker-controlled: a 100 kB PNG can declare 50,000 x 50,000 pixels (7.5 GB as RGB),
its label can lie about its format, its bytes can be truncated or corrupt. So, in order:

1. its compressed size is bounded (`ImageBounds.max_bytes`) before PIL sees it;
2. its magic bytes must match the label (`png` / `jpeg`);
3. `Image.open` reads only the header (PIL is lazy): the declared width and height must
   be >= 1 and their product within `ImageBounds.max_pixels`, *before* `load()` decodes;
4. only then is it decoded, and every decoder failure (truncated, bad CRC, bad Huffman
   table) is a `ImageError` naming the chunk.

PIL's own `Image.MAX_IMAGE_PIXELS` is process-global state: it is never changed here
(another thread may be decoding); its `DecompressionBombError`, raised by `Image.open`
for more than twice that many pixels, is caught and reported like our own bound.
"""

from __future__ import annotations

import hashlib
import io
import re
import struct
import zlib
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

MAGIC = {"png": (b"\x89PNG\r\n\x1a\n",), "jpeg": (b"\xff\xd8\xff",)}
PIL_FORMAT = {"png": "PNG", "jpeg": "JPEG"}
# what a decoder can raise on hostile bytes (PIL documents OSError; plugins leak the rest)
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error, IndexError,
                  TypeError, Image.DecompressionBombError, UnidentifiedImageError)


class ImageError(ValueError):
    """An image the caller sent cannot be used (the message names where and why)."""


@dataclass(frozen=True)
class ImageBounds:
    """What one image may cost: compressed bytes and decoded pixels (width x height)."""

    max_bytes: int = 10 * 1024 * 1024
    max_pixels: int = 16_777_216

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ImageBounds.{name} must be an integer >= 1, got {value!r}")


def image_digest(data: bytes) -> str:
    """The content key of an image (prefix caches key images by it, never by position)."""
    return hashlib.sha256(data).hexdigest()


def check_format(data: bytes, fmt: str, where: str) -> None:
    """The label is one ember decodes and the bytes start as that format does."""
    if fmt not in MAGIC:
        raise ImageError(f"{where}: format expected 'png' or 'jpeg', got {fmt!r}")
    if not any(data.startswith(m) for m in MAGIC[fmt]):
        actual = next((f for f, ms in MAGIC.items() if any(data.startswith(m) for m in ms)), None)
        got = f"the bytes are {actual}" if actual else "the bytes are neither png nor jpeg"
        raise ImageError(f"{where}: format is {fmt!r} but {got} (first bytes {data[:8].hex()})")


def probe_image(data: bytes, fmt: str, bounds: ImageBounds, where: str) -> tuple[int, int]:
    """(width, height) the image declares, checked against `bounds`; nothing is decoded."""
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise ImageError(f"{where}: data is empty (0 bytes)")
    if len(data) > bounds.max_bytes:
        raise ImageError(f"{where}: {len(data)} bytes; the limit is max_image_bytes={bounds.max_bytes}")
    check_format(bytes(data[:16]), fmt, where)
    if fmt == "png" and data[12:16] == b"IHDR" and 0 in struct.unpack(">II", data[16:24]):
        # PIL would call it unidentifiable; say what is wrong
        raise ImageError(f"{where}: declares a zero-size image ({'x'.join(map(str, struct.unpack('>II', data[16:24])))})")
    with _open(data, fmt, bounds, where) as img:
        return img.size


def decode_image(data: bytes, fmt: str, bounds: ImageBounds, where: str) -> Image.Image:
    """The image as RGB pixels, refused (`ImageError`) before decoding when over `bounds`."""
    probe_image(data, fmt, bounds, where)
    with _open(data, fmt, bounds, where) as img:
        try:
            img.load()
            return img.convert("RGB")
        except _DECODE_ERRORS as exc:
            raise ImageError(f"{where}: the {fmt} data is corrupt or truncated ({_reason(exc)})") from None


def verify_image(data: bytes, fmt: str, bounds: ImageBounds, where: str) -> tuple[int, int]:
    """(width, height) of an image that decodes whole (`ImageError` otherwise), its pixels
    dropped at once: what admission needs to know, at the decoder's own size (1 to 4 bytes
    a pixel) rather than `decode_image`'s RGB copy beside it."""
    probe_image(data, fmt, bounds, where)
    with _open(data, fmt, bounds, where) as img:
        try:
            img.load()
        except _DECODE_ERRORS as exc:
            raise ImageError(f"{where}: the {fmt} data is corrupt or truncated ({_reason(exc)})") from None
        return img.size


def _open(data: bytes, fmt: str, bounds: ImageBounds, where: str) -> Image.Image:
    """`Image.open` (header only) with the declared size checked against `bounds`."""
    try:
        # (not warnings.catch_warnings: it mutates the process's filters, as unsafe as
        # MAX_IMAGE_PIXELS; PIL only warns above 89M pixels, past the default bound)
        img = Image.open(io.BytesIO(data), formats=[PIL_FORMAT[fmt]])
    except Image.DecompressionBombError as exc:
        raise ImageError(f"{where}: declares too many pixels ({_reason(exc)}); the limit is "
                         f"max_image_pixels={bounds.max_pixels}") from None
    except _DECODE_ERRORS as exc:
        raise ImageError(f"{where}: not a readable {fmt} image ({_reason(exc)})") from None
    width, height = img.size
    if width < 1 or height < 1:
        img.close()
        raise ImageError(f"{where}: declares a zero-size image ({width}x{height})")
    if width * height > bounds.max_pixels:
        img.close()
        raise ImageError(f"{where}: declares {width}x{height} = {width * height} pixels; the limit is "
                         f"max_image_pixels={bounds.max_pixels}")
    return img


def _reason(exc: BaseException) -> str:
    text = re.sub(r"<_io\.BytesIO object at 0x[0-9a-f]+>", "the bytes", str(exc)) or type(exc).__name__
    return text if len(text) <= 200 else text[:200] + "..."
