"""`Limits`: every count and size a request carries, bounded before anything is allocated,
and the quotas of one API key.

An untrusted request names counts (samples, tokens, datums, top-k sizes, how far ahead a
`seq_id` is) that decide how much memory and time the service will spend on it. Each is
checked here, before a future's sequence ids are made, a sampler slot is reserved or a
lane waits, and refused as a user error naming the field, the value and the limit
(`ember serve --limits.KEY VALUE`, the `[limits]` table of `--config`).

The request body itself is bounded earlier, by the server (`--max-body-mb`), so a
request's lists are already finite when they get here; these limits keep what the
service *derives* from them (KV cache rows, logprob tensors, waits) bounded too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from ember.models.images import ImageBounds
from ember.sampling.config import MAX_LORA_RANK

# Fixed bounds (not settings): the database keeps these as 64-bit integers, so a bigger
# JSON number (Python reads any size) is refused by the server instead of reaching SQLite
# as an OverflowError (a 500); listing pages are bounded the same way.
INT64_FIELDS = ("seq_id", "model_seq_id", "sampling_session_seq_id", "ttl_seconds")
MAX_PAGE_SIZE = 1000
MAX_OFFSET = 2**31 - 1

DEFAULT_DATUM_TOKENS = 131072  # the datum limit for a model whose config names no positions


def refused(message: str) -> Exception:
    """The `UserError` a check raises. Imported here, not at module import: `Limits` is a
    setting of `ember serve`, checked before tinker (and torch) are loaded."""
    from ember.service.api import UserError

    return UserError(message)


@dataclass
class Limits:
    """Per-request limits of the service (each refused as a user error naming the field).

    A new limit is a field here with its default and a `name: text` entry below: that
    makes it a `--limits.NAME` flag, a `[limits]` key and a row of README's limits table.

    max_num_samples: `num_samples` of one sample request.
    max_sample_tokens: `sampling_params.max_tokens` (new tokens per sample).
    max_prompt_tokens: tokens of one sampling prompt.
    max_topk_logprobs: `topk_prompt_logprobs`, `topk_sample_logprobs` and
        `prompt_alt_tokens_k`.
    max_datums_per_request: datums of one forward / forward_backward request.
    max_datum_tokens: `model_input` tokens of one datum; None (the default): the model's
        positions (`max_position_embeddings` in its config.json; `DEFAULT_DATUM_TOKENS` for a
        model that names none). A number caps every model at it, never above its positions. Also
        `max_context_length` in `get_server_capabilities`.
    max_request_tokens: `model_input` tokens of all datums of one request together.
    max_seq_ahead: how far a training request's `seq_id` may be ahead of the next one the
        run expects (further would wait, then skip every request in between).
    max_lora_rank: `lora_config.rank` of a new training run (its adapters' memory grows
        with it); also the rank every sampler is sized for (`MAX_LORA_RANK`).
    max_result_bytes: the stored (pickled) result of one request; a bigger one fails as a
        user error instead of being kept as a future row (e.g. a forward with a huge top-K).
    max_json_body_bytes: a JSON request body (the body limit, `--max-body-mb`, is for the
        protobuf `forward_backward`): one 47 MB string takes the parser, which holds the
        interpreter lock, too long.
    max_json_values: values (and object entries) of one JSON request body, counted from its
        bytes before it is parsed: parsing holds the interpreter lock, so this bounds how
        long one body can keep every other request waiting (~1 s per million on one core);
        the default fits a sampling prompt of `max_prompt_tokens` with its target logprobs.
    max_protobuf_fields: fields of one protobuf request body (forward_backward) at every
        level, counted before it is parsed, for the same reason (a datum with one chunk
        and two inputs is about 10; 32 for each of `max_datums_per_request`).
    max_json_depth: nesting depth of a JSON request body (deeper is refused before any
        recursive code sees it).
    max_metadata_bytes: `user_metadata` of a session or training run, as compact JSON.
    max_metadata_keys: object keys in such `user_metadata`, at every level together.
    max_metadata_depth: nesting depth of such `user_metadata` (a flat object is 1).
    max_openai_n: `n` of an OpenAI-compatible request.
    max_openai_top_logprobs: `top_logprobs` (chat) and `logprobs` (completions).
    max_openai_logprob_entries: n x max_tokens x (1 + top_logprobs) of an OpenAI request
        that asks for logprobs: the entries its response would hold, bounded before sampling.
    max_openai_response_bytes: the JSON answer of an OpenAI-compatible request; a bigger
        one is refused (400) instead of being sent.

    Quotas per API key (owner), so that one tenant cannot take a shared server's memory or
    disk from the others; each refusal names the quota and how to free it:
    max_runs_per_key: training runs loaded at once (created and not yet unloaded: a
        run is unloaded when its session is finished, or expires without heartbeats or idle).
    max_sessions_per_key: client sessions active at once (one per `ServiceClient`; ended
        by closing it, after `sessions.heartbeat_timeout_s` without a heartbeat (the client
        died), or after `sessions.idle_ttl_s` without requests).
    max_sampling_sessions_per_key: sampling sessions (weight versions) loaded at once,
        over all the key's sessions (each session also keeps at most
        `max_samplers_per_session`).
    max_checkpoint_bytes_per_key: bytes of the key's saved checkpoints not past their
        TTL (a save that would go beyond it is refused and its files removed).
    max_queued_samples_per_key: samples one API key may have queued or running in the
        samplers at once (`asample` returns at once, so this is what bounds a backlog).
    max_queued_sample_tokens_per_key: the same in tokens, num_samples x (prompt tokens +
        max_tokens) summed over the key's queued or running sample requests.

    Images (`ImageChunk`, `ImageAssetPointerChunk`; `ember.models.images`), checked before
    any is decoded:
    max_image_bytes: compressed bytes of one image (its png/jpeg data or file).
    max_image_pixels: width x height one image declares in its header (a 100 kB PNG can
        declare 50,000 x 50,000: refused before it is decoded).
    max_images_per_request: images of one request, all datums (or the prompt) together.
    max_request_image_pixels: width x height summed over the images of one request, read
        from their headers before any is decoded (64 small PNGs can each declare 4096 x 4096).
    max_decoding_image_pixels: decoded pixels in flight across the server (1 to 4 bytes
        each while an image is checked); each API key gets a fair share of it, and a
        request over its key's share waits (then 429). At least max_image_pixels.
    max_image_decode_threads: threads that decode images (one pool for the server).
    max_image_requests_per_key: requests of one API key having their images checked at
        once; more get 429 with Retry-After (the SDK retries them).
    """

    max_num_samples: int = 256
    max_sample_tokens: int = 32768
    max_prompt_tokens: int = 131072
    max_topk_logprobs: int = 100
    max_datums_per_request: int = 4096
    max_datum_tokens: int | None = None
    max_request_tokens: int = 1048576
    max_seq_ahead: int = 1024
    max_lora_rank: int = MAX_LORA_RANK
    max_runs_per_key: int = 16
    max_sessions_per_key: int = 256
    max_sampling_sessions_per_key: int = 64
    max_checkpoint_bytes_per_key: int = 200 * 1024**3
    max_result_bytes: int = 64 * 1024 * 1024
    max_json_body_bytes: int = 16 * 1024 * 1024
    max_json_values: int = 400_000
    max_json_depth: int = 64
    max_protobuf_fields: int = 131072
    max_metadata_bytes: int = 65536
    max_metadata_keys: int = 1024
    max_metadata_depth: int = 8
    max_openai_n: int = 128
    max_openai_top_logprobs: int = 20
    max_openai_logprob_entries: int = 262144
    max_openai_response_bytes: int = 32 * 1024 * 1024
    max_queued_samples_per_key: int = 16384
    max_queued_sample_tokens_per_key: int = 8_388_608
    max_image_bytes: int = 10 * 1024 * 1024
    max_image_pixels: int = 16_777_216
    max_images_per_request: int = 1024
    max_request_image_pixels: int = 268_435_456
    max_decoding_image_pixels: int = 67_108_864
    max_image_decode_threads: int = 2
    max_image_requests_per_key: int = 4

    def __post_init__(self) -> None:
        # every limit is a positive number: an int field an integer >= 1, a float one > 0
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and "None" in str(f.type):
                continue  # an optional limit left unset (e.g. max_datum_tokens: the model's positions)
            if f.type in (float, "float"):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                    raise ValueError(f"limits.{f.name} must be a number > 0, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"limits.{f.name} must be an integer >= 1, got {value!r}")
        if self.max_decoding_image_pixels < self.max_image_pixels:
            raise ValueError(f"limits.max_decoding_image_pixels={self.max_decoding_image_pixels} must be at least "
                             f"limits.max_image_pixels={self.max_image_pixels} (one image must fit)")

    @property
    def image_bounds(self) -> ImageBounds:
        return ImageBounds(max_bytes=self.max_image_bytes, max_pixels=self.max_image_pixels)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # ------------------------------------------------------------------ sampling
    def check_sample(self, num_samples: Any, prompt: Any, sampling_params: Any, topk_prompt: Any,
                     topk_sample: Any, alt_tokens_k: Any = 0) -> None:
        """A sample request's counts; called before its future reserves sequence ids."""
        _bounded("num_samples", num_samples, self.max_num_samples, minimum=1)
        max_tokens = getattr(sampling_params, "max_tokens", None)
        if max_tokens is not None:
            _bounded("sampling_params.max_tokens", max_tokens, self.max_sample_tokens, minimum=0)
        n_prompt = prompt_length(prompt)
        if n_prompt is not None and n_prompt > self.max_prompt_tokens:
            raise refused(f"prompt has {n_prompt} tokens; the limit is max_prompt_tokens={self.max_prompt_tokens}")
        _bounded("topk_prompt_logprobs", topk_prompt or 0, self.max_topk_logprobs, minimum=0)
        _bounded("topk_sample_logprobs", topk_sample or 0, self.max_topk_logprobs, minimum=0)
        _bounded("prompt_alt_tokens_k", alt_tokens_k or 0, self.max_topk_logprobs, minimum=0)

    # ------------------------------------------------------------------ training
    def datum_tokens(self, positions: int | None) -> tuple[int, str]:
        """(the longest datum a model with `positions` accepts, the setting that says so)."""
        if self.max_datum_tokens is None:
            if positions:
                return positions, f"the model's max_position_embeddings={positions}"
            return DEFAULT_DATUM_TOKENS, f"max_datum_tokens={DEFAULT_DATUM_TOKENS}"
        if positions and positions < self.max_datum_tokens:
            return positions, f"the model's max_position_embeddings={positions}"
        return self.max_datum_tokens, f"max_datum_tokens={self.max_datum_tokens}"

    def check_datums(self, data: Sequence[Any], positions: int | None = None) -> None:
        """A forward(_backward) request's datum count and token lengths; before it is queued.
        `positions`: the run's model's `max_position_embeddings` (None: unknown)."""
        if len(data) > self.max_datums_per_request:
            raise refused(f"data has {len(data)} datums; the limit is "
                            f"max_datums_per_request={self.max_datums_per_request}")
        longest, why = self.datum_tokens(positions)
        total = 0
        for i, datum in enumerate(data):
            n = prompt_length(getattr(datum, "model_input", None))
            if n is None:
                continue  # malformed datums are the engine's validation's to name
            if n > longest:
                raise refused(f"data[{i}].model_input has {n} tokens; the limit is {why}")
            total += n
        if total > self.max_request_tokens:
            raise refused(f"data has {total} model_input tokens in all; the limit is "
                            f"max_request_tokens={self.max_request_tokens}")

    def check_lora_rank(self, lora_config: Any) -> None:
        rank = getattr(lora_config, "rank", None)
        if isinstance(rank, int) and not isinstance(rank, bool) and rank > self.max_lora_rank:
            raise refused(f"lora_config.rank={rank} is over the limit max {self.max_lora_rank} "
                            "(limits.max_lora_rank)")

    def check_user_metadata(self, meta: Any, field: str = "user_metadata") -> None:
        """A session's or run's `user_metadata` (any JSON object): depth, keys and bytes,
        before it is stored (a listing returns it: unbounded, one row could be 90 MB)."""
        if meta is None:
            return
        if not isinstance(meta, Mapping):
            raise refused(f"{field} must be a JSON object, got {type(meta).__name__}")
        keys = check_json_tree(meta, self.max_metadata_depth, field, "max_metadata_depth")
        if keys > self.max_metadata_keys:
            raise refused(f"{field} has {keys} keys; the limit is max_metadata_keys={self.max_metadata_keys}")
        try:
            size = len(json.dumps(meta, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode())
        except (TypeError, ValueError) as exc:
            raise refused(f"{field} must hold JSON values only ({exc})") from exc
        if size > self.max_metadata_bytes:
            raise refused(f"{field} is {size} bytes as JSON; the limit is "
                            f"max_metadata_bytes={self.max_metadata_bytes}")

    def check_result_size(self, size: int) -> None:
        if size > self.max_result_bytes:
            raise refused(f"the result of this request is {size} bytes; the limit is "
                            f"max_result_bytes={self.max_result_bytes} (ask for less: fewer datums, "
                            "samples, tokens or top-k)")

    def check_seq_ahead(self, seq_id: int, next_seq: int, model_id: str) -> None:
        if seq_id - next_seq > self.max_seq_ahead:
            raise refused(f"seq_id {seq_id} of {model_id} is {seq_id - next_seq} ahead of the next expected "
                            f"({next_seq}); the limit is max_seq_ahead={self.max_seq_ahead}")


def check_json_tree(doc: Any, max_depth: int, where: str = "body", limit_name: str = "max_json_depth") -> int:
    """Walk a parsed JSON document without recursion: nesting deeper than `max_depth`
    (scalars at the top are depth 0, a flat object or list 1) and strings or keys holding
    a lone surrogate (JSON's `"\\udcff"`: no UTF-8 encoding, so the database, the
    tokenizer and the log could not take it) are refused naming the path. Returns how
    many object keys the document holds."""
    if isinstance(doc, str):
        _check_text(doc, where, None)
    keys = 0
    # Only containers are pushed (scalars are checked in place): no object per value, so a
    # big document sets off no extra garbage collection, which would hold the lock.
    stack: list[tuple[Any, int, Any]] = [(doc, 0, None)] if isinstance(doc, (Mapping, list, tuple)) else []
    while stack:
        value, depth, path = stack.pop()  # path: (parent path, key), built out only for an error
        if depth + 1 > max_depth:
            raise refused(f"{_path_text(where, path)}: nested deeper than {max_depth} levels "
                            f"({limit_name}={max_depth})")
        items = value.items() if isinstance(value, Mapping) else enumerate(value)
        keys += len(value) if isinstance(value, Mapping) else 0
        for key, item in items:
            if isinstance(key, str):
                _check_text(key, where, (path, key))
            if isinstance(item, str):
                _check_text(item, where, (path, key))
            elif isinstance(item, (Mapping, list, tuple)):
                stack.append((item, depth + 1, (path, key)))
    return keys


def _check_text(text: str, where: str, path: Any) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise refused(f"{_path_text(where, path)}: holds a lone UTF-16 surrogate "
                        f"({text[exc.start]!r} at character {exc.start}); send valid Unicode text") from None


def _path_text(where: str, path: Any) -> str:
    parts: list[str] = []
    while path is not None:
        path, key = path
        parts.append(f"[{key}]" if isinstance(key, int) else f".{_safe(key)}")
    parts.reverse()
    return where + "".join(parts[:8]) + (f"...({len(parts) - 8} more levels)" if len(parts) > 8 else "")


def _safe(key: str) -> str:
    """A key fit for an error message: surrogates escaped, long ones cut."""
    text = key.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= 64 else text[:64] + "..."


def _bounded(field: str, value: Any, limit: int, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise refused(f"{field} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise refused(f"{field} must be >= {minimum}, got {value}")
    if value > limit:
        raise refused(f"{field}={value} is over the limit max {limit} (limits.{_LIMIT_OF[field]})")


_LIMIT_OF = {
    "num_samples": "max_num_samples",
    "sampling_params.max_tokens": "max_sample_tokens",
    "topk_prompt_logprobs": "max_topk_logprobs",
    "topk_sample_logprobs": "max_topk_logprobs",
    "prompt_alt_tokens_k": "max_topk_logprobs",
}


def prompt_length(model_input: Any) -> int | None:
    """Tokens of a `ModelInput` without materialising them (None when it is not one). An
    image chunk without `expected_tokens` (the SDK's `length` raises for it) counts as one
    token here: the model's count is known only once it is expanded, where the sampler's
    `max_len` and the engine's datum checks apply."""
    chunks = getattr(model_input, "chunks", None)
    if not isinstance(chunks, list):
        return None
    try:
        return sum(1 if getattr(c, "type", "") in _IMAGE_TYPES and c.expected_tokens is None else int(c.length)
                   for c in chunks)
    except Exception:  # noqa: BLE001 - a malformed chunk is the validator's to report
        return None


_IMAGE_TYPES = ("image", "image_asset_pointer")
