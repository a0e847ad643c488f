"""Images for tests: real PNG/JPEG bytes made in code, and hostile ones.

Each hostile case is bytes a client could send: a header that lies about the size (a
decompression bomb), truncated or corrupt data, a label that does not match the bytes.
"""

from __future__ import annotations

import io
import struct
import zlib

from PIL import Image


def image_bytes(width: int = 56, height: int = 56, color=(200, 30, 30), fmt: str = "png") -> bytes:
    img = Image.new("RGB", (width, height), color)
    buf = io.BytesIO()
    img.save(buf, format={"png": "PNG", "jpeg": "JPEG"}[fmt])
    return buf.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_claiming(width: int, height: int, payload: int = 100_000) -> bytes:
    """A valid-looking PNG whose header declares `width` x `height` RGB pixels, with
    `payload` bytes of zeros compressed as its data (~100 bytes: far too few rows)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr)
            + _png_chunk(b"IDAT", zlib.compress(b"\0" * payload)) + _png_chunk(b"IEND", b""))


def hostile_images() -> dict[str, tuple[bytes, str, str]]:
    """name -> (data, format label, a word the refusal must contain)."""
    good = image_bytes(56, 56)
    return {
        "bomb_50000x50000": (png_claiming(50_000, 50_000), "png", "pixels"),
        "bomb_8000x8000": (png_claiming(8000, 8000), "png", "max_image_pixels"),
        "truncated": (good[: len(good) // 2], "png", "corrupt"),
        "garbage": (b"\x89PNG\r\n\x1a\n" + b"\x07" * 200, "png", "png"),
        "label_mismatch": (image_bytes(56, 56, fmt="jpeg"), "png", "jpeg"),
        "not_an_image": (b"hello world, not an image", "jpeg", "neither png nor jpeg"),
        "zero_size": (png_claiming(0, 56, payload=10), "png", "zero"),
        "empty": (b"", "png", "empty"),
    }
