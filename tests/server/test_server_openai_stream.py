"""`stream=true`: the incremental text and OpenAI's stream chunks (`openai_compat.TextStream`,
`StreamChunks`, pure); the official `openai` client reading them from `ember serve` as they are
sampled, and hanging up: tests/server/test_server_openai.py."""

from __future__ import annotations

import pytest

from ember.server import openai_compat as oa

USAGE = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


class ByteTokenizer:
    """Token t is byte t (a byte-level tokenizer's worst case: one character over two tokens)."""

    def decode(self, tokens, skip_special_tokens=True) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")


def _pushed(stream: oa.TextStream, tokens) -> list[str]:
    return [stream.push([t]) for t in tokens]


def test_text_streams_by_token_and_waits_out_a_split_character():
    tokens = list("a\u00e9b".encode())  # a, then é as two bytes, then b
    stream = oa.TextStream(ByteTokenizer(), stop=[])
    assert _pushed(stream, tokens) == ["a", "", "\u00e9", "b"]
    assert stream.finish("a\u00e9b") == ""


def test_text_holds_back_what_could_start_a_stop_string():
    text = "hello END"
    stream = oa.TextStream(ByteTokenizer(), stop=["END", "x"])
    pushed = _pushed(stream, list(text.encode()))  # the sampler ends the sequence at the "D"
    assert pushed[:8] == ["", "", "h", "e", "l", "l", "o", " "]  # the last 2 characters wait
    assert pushed[8:] == [""]  # the stop string, complete, is never sent
    final = "hello "  # completion_text leaves the stop string out
    assert stream.finish(final) == ""


def test_chat_chunks_start_with_the_role_and_end_with_finish_then_usage():
    chunks = oa.StreamChunks(chat=True, model="m", include_usage=True)
    out = [chunks.start(0), chunks.text(0, "ab"), chunks.finish(0, {"content": []}, "stop"), chunks.usage(USAGE)]
    assert [c["object"] for c in out] == ["chat.completion.chunk"] * 4 and len({c["id"] for c in out}) == 1
    assert [c["choices"][0]["delta"] for c in out[:3]] == [{"role": "assistant", "content": ""}, {"content": "ab"},
                                                           {}]
    assert [c["choices"][0]["finish_reason"] for c in out[:3]] == [None, None, "stop"]
    assert out[2]["choices"][0]["logprobs"] == {"content": []}
    assert out[-1]["choices"] == [] and out[-1]["usage"] == USAGE and all(c["usage"] is None for c in out[:-1])


def test_completion_chunks_have_text_and_no_usage_unless_asked():
    chunks = oa.StreamChunks(chat=False, model="m", include_usage=False)
    out = [chunks.text(1, "xyz"), chunks.finish(1, None, "length")]
    assert [(c["choices"][0]["index"], c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in out] == [
        (1, "xyz", None), (1, "", "length")]
    assert all("usage" not in c and c["object"] == "text_completion" for c in out)


def test_stream_options_need_stream():
    req = oa.CompletionRequest(model="m", prompt="hi", stream_options={"include_usage": True})
    with pytest.raises(oa.Unsupported, match="stream_options: only with stream=true"):
        req.check_supported()
    streamed = oa.CompletionRequest(model="m", prompt="hi", stream=True, stream_options={"include_usage": True})
    streamed.check_supported()
    assert streamed.include_usage() and not oa.CompletionRequest(model="m", prompt="hi", stream=True).include_usage()
