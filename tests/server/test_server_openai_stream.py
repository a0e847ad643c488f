"""`stream=true` answers as OpenAI's stream chunks (`openai_compat.stream_chunks`, pure); the
official `openai` client reading them from `ember serve`: tests/server/test_server_openai.py."""

from __future__ import annotations

import pytest

from ember.server import openai_compat as oa

USAGE = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_chat_chunks_carry_each_choice_then_its_finish_then_the_usage():
    body = oa.envelope("chat.completion", "m", [
        {"index": 0, "message": {"role": "assistant", "content": "ab"}, "logprobs": None, "finish_reason": "stop"},
        {"index": 1, "message": {"role": "assistant", "content": "c"}, "logprobs": None, "finish_reason": "length"},
    ], USAGE)
    chunks = oa.stream_chunks(body, include_usage=True)
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 5 and {c["id"] for c in chunks} == {body["id"]}
    assert [c["choices"][0]["delta"] for c in chunks[:4]] == [{"role": "assistant", "content": "ab"}, {},
                                                              {"role": "assistant", "content": "c"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:4]] == [None, "stop", None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == USAGE
    assert all(c["usage"] is None for c in chunks[:-1])


def test_completion_chunks_and_no_usage_unless_asked():
    body = oa.envelope("text_completion", "m", [{"index": 0, "text": "xyz", "logprobs": {"tokens": ["x"]},
                                                 "finish_reason": "length"}], USAGE)
    chunks = oa.stream_chunks(body, include_usage=False)
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == [("xyz", None),
                                                                                             ("", "length")]
    assert chunks[0]["choices"][0]["logprobs"] == {"tokens": ["x"]} and "usage" not in chunks[0]


def test_stream_options_need_stream():
    req = oa.CompletionRequest(model="m", prompt="hi", stream_options={"include_usage": True})
    with pytest.raises(oa.Unsupported, match="stream_options: only with stream=true"):
        req.check_supported()
    streamed = oa.CompletionRequest(model="m", prompt="hi", stream=True, stream_options={"include_usage": True})
    streamed.check_supported()
    assert streamed.include_usage() and not oa.CompletionRequest(model="m", prompt="hi", stream=True).include_usage()
