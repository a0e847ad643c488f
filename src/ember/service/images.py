"""The images of one request, checked before it is queued: counts, sizes, declared
dimensions, and `ImageAssetPointerChunk` locations (docs/architecture.md, "Trust boundaries").

`check_request_images` runs in `Service.forward_backward` and `Service.sample` (so in
process, over HTTP, and for the OpenAI route's `data:` URLs alike), before a future is
made. It

* counts the request's images (`Limits.max_images_per_request`);
* reads every image's header before any is decoded (`ember.models.images.probe_image`:
  bytes, magic, declared dimensions) and bounds the request's total
  (`Limits.max_request_image_pixels`);
* checks each image's `expected_tokens` against the model's own count (given the base
  model's `VisionSpec`), from the declared size where the processor counts from sizes,
  so a wrong count is refused when the request arrives, not after it waited on the run's lane;
* decodes each image once, under the server's decoding budget and on its decoding
  threads (`ember.service.image_admission`), so corrupt data is refused here;
* turns each `ImageAssetPointerChunk` into the `ImageChunk` of its file, when its
  location is a regular file whose real path (symlinks and `..` resolved) lies under an
  operator's `--image-root` and not under the data directory, the rules `ModelRegistry`
  applies to model roots. ember never fetches a URL: any `scheme:` spelling is refused.
  Below the service, every image is an `ImageChunk` with its bytes.

Each refusal is a `UserError` naming the datum (or prompt) and the chunk index.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tinker import types

from ember.models.images import ImageBounds, ImageError, decode_image, probe_image, verify_image
from ember.models.vision import VisionSpec, check_image_size_tokens, check_image_tokens, load_vision_spec
from ember.service.api import UserError
from ember.service.image_admission import ImageAdmission
from ember.service.limits import Limits
from ember.service.model_registry import real_path

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:")  # http:, https:, file:, data:, s3:, C: ...
IMAGE_CHUNKS = (types.ImageChunk, types.ImageAssetPointerChunk)


def count_images(model_input: types.ModelInput) -> int:
    """Image chunks of `model_input` (0 for anything else: malformed input is the validator's)."""
    chunks = getattr(model_input, "chunks", None)
    return sum(isinstance(c, IMAGE_CHUNKS) for c in chunks) if isinstance(chunks, list) else 0


@functools.lru_cache(maxsize=16)
def vision_spec_of(model_dir: str) -> VisionSpec | None:
    """The `VisionSpec` of the model in `model_dir` (None: a text-only model), loaded once."""
    return load_vision_spec(model_dir)


@dataclass(frozen=True)
class Probed:
    """One image chunk of a request, its header read: where it is, its bytes, its size."""

    name: str
    index: int
    where: str
    chunk: types.ImageChunk
    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height


def check_request_images(inputs: Sequence[tuple[str, types.ModelInput]], limits: Limits,
                         roots: Sequence[Path] = (), private: Sequence[Path] = (),
                         spec: VisionSpec | None = None, *, owner: str = "local",
                         admission: ImageAdmission | None = None) -> list[types.ModelInput]:
    """Each `(name, model_input)` checked; returns the inputs with pointers read into
    `ImageChunk`s (an input without images is returned as is). With the model's `spec`,
    each image's `expected_tokens` is checked against the model's count too.

    In order: the count; every image's bytes, format and header size (pointers read); the
    request's pixel total; the token counts from the sizes; only then the decodes, under
    `admission`'s budget and pool for `owner` (without one, in the calling thread: for a
    single caller, such as a test or a tool)."""
    total = sum(count_images(mi) for _, mi in inputs)
    if total > limits.max_images_per_request:
        raise UserError(f"the request holds {total} images; the limit is "
                        f"max_images_per_request={limits.max_images_per_request}")
    if not total:
        return [mi for _, mi in inputs]
    with admission.request(owner) if admission is not None else contextlib.nullcontext():
        return _checked(inputs, limits, roots, private, spec, owner, admission)


def _checked(inputs: Sequence[tuple[str, types.ModelInput]], limits: Limits, roots: Sequence[Path],
             private: Sequence[Path], spec: VisionSpec | None, owner: str,
             admission: ImageAdmission | None) -> list[types.ModelInput]:
    bounds = limits.image_bounds
    resolved = [_resolved(name, mi, bounds, roots, private) for name, mi in inputs]
    probed = [p for _, ps in resolved for p in ps]
    pixels = sum(p.pixels for p in probed)
    if pixels > limits.max_request_image_pixels:
        raise UserError(f"the request's {len(probed)} images declare {pixels} pixels in all; the limit is "
                        f"max_request_image_pixels={limits.max_request_image_pixels}")
    if _counted_by_size(probed, spec):
        spec = None  # nothing left for a decode to count
    jobs = [(p.pixels, p.where, functools.partial(_decoded, p, bounds, spec)) for p in probed]
    if admission is not None:
        admission.decode(owner, jobs)
    else:
        for _, _, decode in jobs:
            decode()
    return [mi for mi, _ in resolved]


def _resolved(name: str, model_input: types.ModelInput, bounds: ImageBounds, roots: Sequence[Path],
              private: Sequence[Path]) -> tuple[types.ModelInput, list[Probed]]:
    """The input with its pointers read, and its images' headers checked (nothing decoded)."""
    if not count_images(model_input):
        return model_input, []
    chunks, probed = [], []
    for j, chunk in enumerate(model_input.chunks):
        if isinstance(chunk, IMAGE_CHUNKS):
            where = f"{name}: chunk {j} ({chunk.type})"
            _check_expected(chunk, where)
            if isinstance(chunk, types.ImageAssetPointerChunk):
                data = read_image_file(chunk.location, roots, private, bounds.max_bytes, where)
                chunk = types.ImageChunk(data=data, format=chunk.format, expected_tokens=chunk.expected_tokens)
            try:
                width, height = probe_image(chunk.data, chunk.format, bounds, where)
            except ImageError as exc:
                raise UserError(str(exc)) from None
            probed.append(Probed(name, j, where, chunk, width, height))
        chunks.append(chunk)
    return types.ModelInput(chunks=chunks), probed


def _counted_by_size(probed: Sequence[Probed], spec: VisionSpec | None) -> bool:
    """Each image's `expected_tokens` checked against the model's count from its declared
    size (UserError on a mismatch); False when the processor counts from pixels only."""
    for p in probed:
        if spec is None or p.chunk.expected_tokens is None:
            continue
        try:
            if check_image_size_tokens(spec, p.chunk, p.width, p.height, _engine_where(p), p.index) is None:
                return False
        except ValueError as exc:
            raise UserError(str(exc)) from None
    return True


def _engine_where(p: Probed) -> str:
    """The engine's words: "datum 3: model_input chunk 1 (image) has ..."."""
    return p.name.split(":", 1)[0]


def _decoded(p: Probed, bounds: ImageBounds, spec: VisionSpec | None) -> None:
    """Decode `p` whole (corrupt data is the caller's 400 now, not a failure inside a shared
    training or sampling batch), with `spec` its token count from the pixels too, then
    drop its pixels."""
    try:
        if spec is not None and p.chunk.expected_tokens is not None:
            image = decode_image(p.chunk.data, p.chunk.format, bounds, p.where)
            check_image_tokens(spec, p.chunk, image, _engine_where(p), p.index)
        else:
            verify_image(p.chunk.data, p.chunk.format, bounds, p.where)
    except ValueError as exc:  # ImageError, or a wrong expected_tokens
        raise UserError(str(exc)) from None


def _check_expected(chunk, where: str) -> None:
    n = chunk.expected_tokens
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise UserError(f"{where}: expected_tokens must be an integer >= 1 or unset, got {n!r}")


def read_image_file(location: str, roots: Sequence[Path], private: Sequence[Path], max_bytes: int,
                    where: str) -> bytes:
    """The bytes of the file `location` names, if an image root allows it (else UserError).

    Every refusal of an allowed-looking path reads the same, so the answer never tells
    whether a file exists outside the roots."""
    if not roots:
        raise UserError(f"{where}: an image_asset_pointer needs the operator's --image-root (none is set); "
                        "send the image's bytes as an ImageChunk instead")
    if not isinstance(location, str) or not location or "\x00" in location or _SCHEME.match(location):
        raise UserError(f"{where}: location {_shown(location)} is not a local file path (ember never fetches "
                        "a URL; file: and other schemes are refused)")
    path = _allowed_file(location, roots, private)
    if path is None:
        raise UserError(f"{where}: location {_shown(location)} is not a readable file under an image root")
    return _read_bounded(path, max_bytes, where)


def _allowed_file(location: str, roots: Sequence[Path], private: Sequence[Path]) -> Path | None:
    candidates = [location] if os.path.isabs(location) else [os.path.join(r, location) for r in roots]
    for candidate in candidates:
        try:
            p = real_path(candidate)
        except (OSError, ValueError):
            continue
        if any(p.is_relative_to(d) for d in private) or not any(p.is_relative_to(r) for r in roots):
            continue
        try:
            if stat.S_ISREG(os.stat(p).st_mode):
                return p
        except (OSError, ValueError):
            continue
    return None


def _read_bounded(path: Path, max_bytes: int, where: str) -> bytes:
    try:
        # O_NOFOLLOW: the checked real path, not a symlink swapped in since
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise OSError("not a regular file")
            data = f.read(max_bytes + 1)
    except OSError:
        raise UserError(f"{where}: the file under the image root could not be read") from None
    if len(data) > max_bytes:
        raise UserError(f"{where}: the file is over {max_bytes} bytes; the limit is max_image_bytes={max_bytes}")
    return data


def _shown(location) -> str:
    text = repr(location)
    return text if len(text) <= 120 else text[:120] + "...'"
