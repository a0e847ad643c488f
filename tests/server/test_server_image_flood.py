"""Issue 43, item 1, reproduced over HTTP: image decode amplification against a real
`ember serve` on a tiny Qwen3-VL under the issue's 8 GB address-space cap
(`prlimit --as=8589934592`), two keys.

Key A floods concurrent `/api/v1/asample` requests, each holding PNGs of 4096 x 4096
(1-bit, ~2 kB each, decoding to 16.7 M pixels) with the last one truncated; key B samples
4 tokens of text and a small image meanwhile. Every A request is refused as the user's
error (a failed future or a 400 naming the limit or the truncated chunk) or with 429
(over its key's share); none is a 5xx; no `MemoryError` or traceback reaches the server's
log; every B request succeeds; the server's peak RSS stays bounded. Then the same for a
training datum, the OpenAI route's `data:` URLs and an image asset pointer.

Concurrency is capped (20 requests) so the test stays a few tens of seconds.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from PIL import Image
from tinker import types

from ember.models.testing import build_tiny_model
from ember.models.vision import load_vision_spec
from helpers.server import API_KEY, MODEL_NAME, OTHER_KEY, ServerProc, memory_cap, start_server
from helpers.vision import COLORS, png_bytes

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

MEMORY_CAP_BYTES = 8 * 1024**3  # the issue's `prlimit --as=8589934592`
FLOOD = 20  # concurrent A requests (the issue sent 20-44)
SIDE = 4096
# what the server may reach: the forked server's resident torch and model, plus the
# decoding budget (max_decoding_image_pixels at <= 4 bytes a pixel) with room for the parsers
PEAK_RSS_BOUND = 3 * 1024**3


def one_bit_png(side: int = SIDE) -> bytes:
    buf = io.BytesIO()
    Image.new("1", (side, side)).save(buf, format="PNG")
    return buf.getvalue()


def image_chunk(data: bytes, expected: int | None = None) -> dict:
    return {"type": "image", "data": base64.b64encode(data).decode(), "format": "png", "expected_tokens": expected}


def flood_prompt(n_images: int) -> dict:
    big = one_bit_png()
    images = [image_chunk(big)] * (n_images - 1) + [image_chunk(big[: len(big) // 2])]
    return {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}, *images]}


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("qwen3-vl"), family="qwen3_vl")


@pytest.fixture(scope="module")
def image_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("image-root")
    big = one_bit_png()
    (root / "big-truncated.png").write_bytes(big[: len(big) // 2])
    return root


def serve(vl_dir: Path, workdir: Path, image_root: Path, *args: str) -> ServerProc:
    return start_server(vl_dir, workdir, wrap=memory_cap(MEMORY_CAP_BYTES),
                        extra_args=["--image-root", str(image_root), *args])


@pytest.fixture(scope="module")
def server(vl_dir, image_root, tmp_path_factory) -> Iterator[ServerProc]:
    """Default limits: the issue's request is refused from its headers."""
    proc = serve(vl_dir, tmp_path_factory.mktemp("flood-defaults"), image_root)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def decoding_server(vl_dir, image_root, tmp_path_factory) -> Iterator[ServerProc]:
    """The per-request pixel bound raised past the attack's, so every image but the last
    is decoded: what bounds the server then is the decoding budget and its fair shares."""
    proc = serve(vl_dir, tmp_path_factory.mktemp("flood-decoding"), image_root,
                 "--limits.max_request_image_pixels", str(2**40))
    yield proc
    proc.stop()


def sampling_session(server: ServerProc, key: str) -> str:
    headers = {"X-API-Key": key}
    with httpx.Client(base_url=server.base_url + "/api/v1", headers=headers, timeout=120) as http:
        r = http.post("/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"})
        r.raise_for_status()
        r = http.post("/create_sampling_session", json={"session_id": r.json()["session_id"],
                                                        "sampling_session_seq_id": 0, "base_model": MODEL_NAME})
        r.raise_for_status()
        return r.json()["sampling_session_id"]


def asample(http: httpx.Client, session: str, seq_id: int, prompt: dict, max_tokens: int = 4) -> dict:
    """The request's outcome: {"status": HTTP status, "error", "category"} or the sample's future."""
    r = http.post("/asample", json={"sampling_session_id": session, "seq_id": seq_id, "num_samples": 1,
                                    "prompt": prompt, "sampling_params": {"max_tokens": max_tokens, "seed": 1}})
    if r.status_code != 200:
        return {"status": r.status_code, **r.json()}
    request_id = r.json()["request_id"]
    while True:
        f = http.post("/retrieve_future", json={"request_id": request_id})
        body = f.json()
        if f.status_code != 200 or body.get("type") != "try_again":
            return {"status": f.status_code, **body}


def peak_rss(server: ServerProc) -> int:
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def flood(server: ServerProc, n_images: int) -> tuple[list[dict], list[dict], float]:
    """FLOOD concurrent A requests of `n_images` each while B samples text and an image:
    (A's outcomes, B's outcomes, the flood's wall time)."""
    a_session, b_session = sampling_session(server, API_KEY), sampling_session(server, OTHER_KEY)
    prompt = flood_prompt(n_images)
    text = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    small = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}, image_chunk(png_bytes(COLORS["red"]))]}
    a_http = httpx.Client(base_url=server.base_url + "/api/v1", headers={"X-API-Key": API_KEY}, timeout=300,
                          limits=httpx.Limits(max_connections=FLOOD + 1))
    b_http = httpx.Client(base_url=server.base_url + "/api/v1", headers={"X-API-Key": OTHER_KEY}, timeout=300)
    start = time.monotonic()
    with a_http, b_http, concurrent.futures.ThreadPoolExecutor(FLOOD + 1) as pool:
        a = [pool.submit(asample, a_http, a_session, i, prompt) for i in range(FLOOD)]
        b = [asample(b_http, b_session, i, small if i % 4 == 3 else text) for i in range(8)]
        a_out = [f.result() for f in a]
    return a_out, b, time.monotonic() - start


def assert_refused_cleanly(server: ServerProc, a_out: list[dict], b_out: list[dict], *words: str) -> None:
    stderr = server.stderr_path.read_text()
    assert "MemoryError" not in stderr and "Traceback" not in stderr, stderr[-4000:]
    assert not [o for o in a_out + b_out if o["status"] >= 500], [o for o in a_out + b_out if o["status"] >= 500]
    assert not [e for e in server.requests() if e.get("status", 500) >= 500]
    kinds = Counter(o["status"] for o in a_out)
    for o in a_out:
        assert o["status"] in (200, 400, 429) and o.get("category") in ("user", "server"), o
        if o["status"] == 429:
            assert o["category"] == "server" and "retry" in o["error"], o
        else:
            assert o["category"] == "user" and any(w in o["error"] for w in words), o
    assert kinds[429] < len(a_out), kinds  # some were decoded and refused for what they hold
    for o in b_out:
        assert o["status"] == 200 and o.get("type") == "sample", o
        assert len(o["sequences"][0]["tokens"]) >= 1
    assert peak_rss(server) < PEAK_RSS_BOUND, peak_rss(server)


def test_the_issues_flood_is_refused_from_the_headers(server):
    """The issue's request, as sent: 64 such PNGs. 64 x 16.7 M pixels is over
    max_request_image_pixels, which the headers show: nothing is decoded."""
    a_out, b_out, took = flood(server, 64)
    assert_refused_cleanly(server, a_out, b_out, "max_request_image_pixels=268435456")
    assert took < 60, took


def test_a_decoding_flood_stays_in_its_budget_and_share(decoding_server):
    """16 such PNGs a request, all decoded but the truncated last: each is refused naming
    it (or with 429), B is served throughout, and memory stays bounded."""
    a_out, b_out, took = flood(decoding_server, 16)
    assert_refused_cleanly(decoding_server, a_out, b_out, "chunk 16 (image): the png data is corrupt or truncated")
    assert took < 120, took


def test_training_datums_openai_urls_and_pointers_are_admitted_the_same_way(decoding_server, vl_dir):
    """The same images in a training datum, as OpenAI `data:` URLs, and behind an image
    asset pointer: refused naming the truncated one, nothing over 499."""
    big = one_bit_png()
    n = load_vision_spec(vl_dir).token_count_of_size(SIDE, SIDE)
    sc = tinker.ServiceClient(base_url=decoding_server.base_url, api_key=API_KEY)
    try:
        tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result(timeout=300)
        chunks = [types.ImageChunk(data=big, format="png", expected_tokens=n)] * 7
        chunks += [types.ImageChunk(data=big[: len(big) // 2], format="png", expected_tokens=n)]
        model_input = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]), *chunks])
        datum = types.Datum(model_input=model_input,
                            loss_fn_inputs={"target_tokens": np.zeros(model_input.length, dtype=np.int64)})
        with pytest.raises(tinker.RequestFailedError, match=r"datum 0: model_input: chunk 8 \(image\): the png data "
                                                            r"is corrupt or truncated"):
            tc.forward([datum], "cross_entropy").result(timeout=300)
        pointer = types.ImageAssetPointerChunk(location="big-truncated.png", format="png", expected_tokens=n)
        sampler = tc.save_weights_and_get_sampling_client()
        with pytest.raises(tinker.RequestFailedError, match=r"chunk 1 \(image_asset_pointer\): the png data is "
                                                            r"corrupt or truncated"):
            sampler.sample(types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1]), pointer]), 1,
                           types.SamplingParams(max_tokens=1)).result(timeout=300)
    finally:
        sc.close("success").result(timeout=60)
    url = "data:image/png;base64,"
    content = [{"type": "image_url", "image_url": {"url": url + base64.b64encode(big).decode()}}] * 7
    content += [{"type": "image_url", "image_url": {"url": url + base64.b64encode(big[: len(big) // 2]).decode()}}]
    r = httpx.post(decoding_server.base_url + "/v1/chat/completions", timeout=300,
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400 and "corrupt or truncated" in r.text, r.text
    assert "Traceback" not in decoding_server.stderr_path.read_text()
