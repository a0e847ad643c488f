"""Issue 43, item 1, in process: every image's header of a request is read before any is
decoded, a request's pixels are bounded in all, decoding holds a server-wide pixel budget
with fair shares per key (`ember.service.image_admission`), and a `MemoryError` while
decoding is a retryable `BusyError`, not a failure of someone else's request."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
from tinker import types

from ember.service.api import BusyError, UserError
from ember.service.image_admission import DECODE_NICE, ImageAdmission, PixelBudget
from ember.service.images import check_request_images
from ember.service.limits import Limits
from helpers.images import image_bytes

from .conftest import wait


def one_bit_png(side: int) -> bytes:
    """A `side` x `side` 1-bit PNG of zeros: a few kB that decode to side**2 pixels (the issue's images)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (side, side)).save(buf, format="PNG")
    return buf.getvalue()


def prompt_of(*images: bytes) -> types.ModelInput:
    chunks = [types.EncodedTextChunk(tokens=[1, 2])]
    chunks += [types.ImageChunk.model_construct(data=d, format="png", expected_tokens=None, type="image") for d in images]
    return types.ModelInput(chunks=chunks)


class Recording(ImageAdmission):
    """An `ImageAdmission` that notes each request's decode jobs (how many pixels each)."""

    def __init__(self, limits: Limits):
        super().__init__(limits)
        self.requests: list[list[int]] = []

    def decode(self, owner, jobs):
        self.requests.append([pixels for pixels, _, _ in jobs])
        return super().decode(owner, jobs)


def test_the_issues_request_is_refused_from_its_headers_before_any_decode():
    """64 PNGs of 4096x4096 (1-bit, a few kB each), the last truncated: over
    max_request_image_pixels from the headers alone, so nothing is decoded."""
    big = one_bit_png(4096)
    limits = Limits()
    admission = Recording(limits)
    try:
        start = time.monotonic()
        with pytest.raises(UserError, match=r"64 images declare 1073741824 pixels in all; the limit is "
                                            r"max_request_image_pixels=268435456"):
            check_request_images([("prompt", prompt_of(*[big] * 63, big[: len(big) // 2]))], limits,
                                 owner="a", admission=admission)
        assert time.monotonic() - start < 5 and admission.requests == []
    finally:
        admission.close()


def test_a_bad_header_anywhere_refuses_the_request_before_any_decode():
    limits = Limits(max_image_pixels=1 << 20)
    admission = Recording(limits)
    try:
        good, mislabelled = image_bytes(64, 64), image_bytes(64, 64, fmt="jpeg")
        with pytest.raises(UserError, match=r"^datum 1: model_input: chunk 3 \(image\): format is 'png' but the bytes "
                                            r"are jpeg"):
            check_request_images([("datum 0: model_input", prompt_of(good, good)),
                                  ("datum 1: model_input", prompt_of(good, good, mislabelled))],
                                 limits, owner="a", admission=admission)
        assert admission.requests == []
        # a truncated image's header reads fine: it is refused by its decode, the others decoded first
        with pytest.raises(UserError, match=r"^prompt: chunk 3 \(image\): the png data is corrupt or truncated"):
            check_request_images([("prompt", prompt_of(good, good, good[:-30]))], limits, owner="a",
                                 admission=admission)
        assert admission.requests == [[4096, 4096, 4096]]
    finally:
        admission.close()


def test_a_key_over_its_share_waits_and_the_other_key_goes_first():
    budget = PixelBudget(total=100, max_requests_per_key=4, wait_s=10)
    order: list[str] = []
    during_b: list[str] = []
    with budget.request("a"), budget.request("a"):
        first = budget.pixels("a", 60, "a1")
        first.__enter__()
        with budget.pixels("a", 40, "a2"):  # alone, "a" may take the whole budget
            assert budget.in_flight() == {"a": 100}

            def b_decodes():
                with budget.request("b"), budget.pixels("b", 30, "b1"):
                    order.append("b")
                    time.sleep(0.4)
                    during_b.extend(order)

            b = threading.Thread(target=b_decodes)
            b.start()
            time.sleep(0.2)  # b waits: the budget is full
            assert order == []
            first.__exit__(None, None, None)  # a's first image is done; a asks for another at once

            def a_again():
                with budget.pixels("a", 20, "a3"):
                    order.append("a")

            a = threading.Thread(target=a_again)
            a.start()
            b.join(5)
            # b (nothing in flight) was granted; a, holding 40, would be at 60 with 20 more: over its
            # share of 50 while b is in, though the budget had room (40 + 30 + 20 <= 100)
            assert during_b == ["b"]
        a.join(5)  # b is out: a's share is the whole budget again
        assert order == ["b", "a"] and budget.in_flight() == {}


def test_over_the_share_too_long_or_too_many_requests_is_busy():
    budget = PixelBudget(total=100, max_requests_per_key=2, wait_s=0.2)
    with budget.request("a"), budget.pixels("a", 100, "a1"):
        with pytest.raises(BusyError, match=r"a2: the server is decoding other images \(100 of "
                                            r"limits.max_decoding_image_pixels=100 pixels in flight, 100 of them"):
            with budget.pixels("a", 10, "a2"):
                pass
        with budget.request("a"), pytest.raises(BusyError, match="limits.max_image_requests_per_key=2"):
            with budget.request("a"):
                pass
        with budget.request("b"):  # another key is not counted against a's bound
            pass
    assert budget.in_flight() == {}


def test_a_memory_error_while_decoding_is_busy_and_frees_the_budget():
    admission = ImageAdmission(Limits(max_decoding_image_pixels=1 << 24, max_image_pixels=1 << 24))

    def decode():
        buffer = bytearray(1 << 20)  # what the failed decode held
        raise MemoryError(len(buffer))

    try:
        with pytest.raises(BusyError, match="prompt: chunk 1: the server ran out of memory decoding this image; "
                                            "retry later") as info:
            admission.decode("a", [(1 << 20, "prompt: chunk 1", decode)])
        assert info.value.__context__ is None  # the failed frames (and their memory) are not kept
        assert admission.budget.in_flight() == {}
        assert admission.decode("a", [(10, "prompt: chunk 1", lambda: "decoded")]) == ["decoded"]
    finally:
        admission.close()


def test_decoding_runs_on_the_pool_threads_only_at_background_priority():
    admission = ImageAdmission(Limits(max_image_decode_threads=2))
    seen: set[str] = set()
    nice: set[int] = set()
    lock = threading.Lock()

    def job():
        with lock:
            seen.add(threading.current_thread().name)
            nice.add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        time.sleep(0.05)

    try:
        threads = [threading.Thread(target=admission.decode, args=(f"k{i}", [(1, "x", job)] * 3)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert seen and seen <= {"ember-image-decode-0", "ember-image-decode-1"}
        if sys.platform.startswith("linux"):  # each thread its own nice value; this one's is unchanged
            ours = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            assert nice == {min(19, ours + DECODE_NICE)} and ours == os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        admission.close()


def test_a_closed_pool_finishes_its_jobs_and_refuses_new_ones():
    admission = ImageAdmission(Limits(max_image_decode_threads=1))
    started = threading.Event()
    out: list = []

    def slow():
        started.set()
        time.sleep(0.2)
        return "done"

    t = threading.Thread(target=lambda: out.append(admission.decode("a", [(1, "x", slow)])))
    t.start()
    started.wait(5)
    admission.close()
    t.join(5)
    assert out == [["done"]]
    with pytest.raises(BusyError, match="shutting down"):
        admission.decode("a", [(1, "x", lambda: None)])


def test_decoding_budget_below_one_image_is_refused_at_start():
    with pytest.raises(ValueError, match="max_decoding_image_pixels=100 must be at least limits.max_image_pixels"):
        Limits(max_decoding_image_pixels=100)


def test_the_service_refuses_an_over_the_pixel_total_sample_as_the_users_error(make_service):
    """Checked before the sampling session is looked up: the refusal is the images'."""
    svc = make_service(limits=Limits(max_request_image_pixels=64 * 64 * 2))
    sub = svc.sample("alice", "nope", 1, prompt_of(*[image_bytes(64, 64)] * 3), 1, types.SamplingParams(max_tokens=1))
    state = wait(svc, "alice", sub)
    assert state.status == "failed" and state.category == "user"
    assert "3 images declare 12288 pixels in all; the limit is max_request_image_pixels=8192" in state.error
