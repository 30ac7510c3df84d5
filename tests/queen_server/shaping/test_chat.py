"""``ChatShaper``: the chat answer passed on as it is, with the usage chunk and the error event.

Every object produced is validated with the installed ``openai`` SDK's own ``ChatCompletion`` /
``ChatCompletionChunk`` types.
"""

from __future__ import annotations

from typing import Any

from openai.types.chat import ChatCompletion, ChatCompletionChunk

from queen_server.shaping.chat import ChatShaper
from shared_schema.answers import (
    CHAT_CHUNK,
    AnswerStamp,
    content_chunk,
    finish_chunk,
    message_choice,
    opening_chunk,
    usage_counts,
)

STAMP = AnswerStamp("chatcmpl-xyz", "org/repo:Q8_0", 1_700_000_123)


def stamped(chunk: dict[str, Any]) -> dict[str, Any]:
    return STAMP.stamp(chunk, CHAT_CHUNK)


def test_chunks_pass_through_untouched_and_valid():
    shaper = ChatShaper(False, STAMP)
    assert shaper.sse_done is True
    assert shaper.opening() == []
    logprob = {"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": []}
    chunks = [stamped(opening_chunk("")), stamped(content_chunk("Hi")),
              stamped(finish_chunk("length"))]
    chunks[1]["choices"][0]["logprobs"] = {"content": [logprob]}
    for chunk in chunks:
        events = shaper.chunk(chunk)
        assert events == [(None, chunk)]
        assert events[0][1] is chunk  # no copy: this runs for every token
        ChatCompletionChunk.model_validate(events[0][1])
    assert shaper.closing(usage_counts(3, 2)) == []


def test_the_usage_chunk_carries_the_requests_stamp():
    shaper = ChatShaper(True, AnswerStamp("chatcmpl-xyz", "org/repo:Q8_0", 1_700_000_123))
    shaper.chunk(stamped(content_chunk("x")))
    usage = usage_counts(4, 6)
    [(name, data)] = shaper.closing(usage)
    assert name is None
    assert data == {"id": "chatcmpl-xyz", "object": CHAT_CHUNK, "created": 1_700_000_123,
                    "model": "org/repo:Q8_0", "choices": [], "usage": usage}
    parsed = ChatCompletionChunk.model_validate(data)
    assert parsed.choices == []
    assert parsed.usage is not None
    assert parsed.usage.total_tokens == 10


def test_the_usage_chunk_of_an_answer_without_chunks_uses_the_given_stamp():
    shaper = ChatShaper(True, AnswerStamp("chatcmpl-given", "m", 5))
    [(_, data)] = shaper.closing(usage_counts(1, 0))
    assert (data["id"], data["created"], data["model"]) == ("chatcmpl-given", 5, "m")
    ChatCompletionChunk.model_validate(data)


def test_a_broken_stream_ends_with_the_error_body():
    error = {"error": {"message": "no worker left", "type": "server_error", "param": None,
                       "code": "worker_lost"}}
    assert ChatShaper(True, STAMP).failed(error) == [(None, error)]


def test_a_whole_answer_is_returned_as_it_is():
    answer = STAMP.answer([message_choice("Hello", "stop", 0), message_choice("Yo", "length", 1)])
    answer["usage"] = usage_counts(3, 2)
    out = ChatShaper(False, STAMP).whole(answer)
    assert out is answer
    parsed = ChatCompletion.model_validate(out)
    assert [c.message.content for c in parsed.choices] == ["Hello", "Yo"]
