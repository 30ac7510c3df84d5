"""The OpenAI answer and chunk builders both sides use, and the queen's check of a worker's frame.

Every builder's output is held to its pydantic model in ``openai_types`` and passes
``answer_problem``; every way a frame can break the shape is caught by both, so the plain checks
and the models cannot drift apart. Key order is pinned where clients see the bytes.
"""

from __future__ import annotations

import base64
import struct
from typing import Any

import orjson
import pytest
from pydantic import BaseModel, ValidationError

from shared_schema import (
    ChatCompletion,
    ChatCompletionChunk,
    Chunk,
    EmbeddingResponse,
    JobError,
    Result,
    Usage,
)
from shared_schema.answers import (
    CHAT_ANSWER,
    CHAT_CHUNK,
    MAX_TOKENS,
    AnswerStamp,
    answer_from_chunks,
    answer_problem,
    chat_chunk,
    checkpoint_chunk,
    chunks_from_answer,
    content_chunk,
    delta_choice,
    embedding_list,
    embeddings_answer,
    finish_chunk,
    floats_to_base64,
    message_choice,
    opening_chunk,
    usage_chunk,
    usage_counts,
)

STAMP = AnswerStamp("chatcmpl-1", "org/repo:Q4_K_M", 1_700_000_000)
USAGE = Usage(prompt_tokens=5, completion_tokens=3, total_tokens=8)


# --- each builder -----------------------------------------------------------------------------


def test_stamp_sets_the_queens_id_model_and_time_keeping_the_workers_key_order():
    data = {"id": "worker-id", "object": "chat.completion.chunk", "model": "w", "choices": []}
    stamped = STAMP.stamp(data, CHAT_CHUNK)
    assert stamped is data  # in place: it runs for every relayed chunk
    assert orjson.dumps(stamped) == (
        b'{"id":"chatcmpl-1","object":"chat.completion.chunk","model":"org/repo:Q4_K_M",'
        b'"choices":[],"created":1700000000}')


def test_chunk_builders_write_the_deltas_the_stream_has_always_had():
    assert opening_chunk("Hi") == {"choices": [
        {"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "finish_reason": None}]}
    assert content_chunk("there", index=1) == {"choices": [
        {"index": 1, "delta": {"content": "there"}, "finish_reason": None}]}
    assert finish_chunk() == {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    assert finish_chunk("length")["choices"][0]["finish_reason"] == "length"
    assert usage_chunk(usage_counts(5, 3)) == {
        "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
    assert chat_chunk([delta_choice({"content": "x"})]) == content_chunk("x")
    assert "usage" not in chat_chunk([])


def test_a_stamped_usage_chunk_is_byte_for_byte_what_clients_get():
    chunk = STAMP.stamp(usage_chunk(USAGE.model_dump()), CHAT_CHUNK)
    assert orjson.dumps(chunk) == (
        b'{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8},'
        b'"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,'
        b'"model":"org/repo:Q4_K_M"}')


def test_a_whole_answer_is_stamped_first_then_its_choices():
    answer = STAMP.answer([message_choice("Hello", "length")])
    assert orjson.dumps(answer) == (
        b'{"id":"chatcmpl-1","object":"chat.completion","created":1700000000,'
        b'"model":"org/repo:Q4_K_M","choices":[{"index":0,"message":{"role":"assistant",'
        b'"content":"Hello"},"finish_reason":"length"}]}')


def test_a_whole_answer_becomes_an_opening_and_a_finish_chunk_per_choice():
    answer = {"choices": [
        {"message": {"role": "assistant", "content": "Hi"}, "finish_reason": None},
        {"index": 1, "message": {"content": None}, "finish_reason": "length"},
    ]}
    assert chunks_from_answer(answer) == [
        opening_chunk("Hi"), finish_chunk("stop"),  # no finish reason given: "stop"
        opening_chunk(None, index=1), finish_chunk("length", index=1),
    ]
    assert chunks_from_answer({}) == []
    assert chunks_from_answer({"choices": [{}]}) == [opening_chunk(""), finish_chunk()]


def test_chunks_become_a_whole_answer_in_the_workers_key_order():
    chunks = [opening_chunk("Hel"), content_chunk(""), content_chunk("lo"), finish_chunk("length")]
    answer = answer_from_chunks(chunks)
    assert orjson.dumps(answer) == (
        b'{"object":"chat.completion","choices":[{"index":0,"finish_reason":"length",'
        b'"message":{"role":"assistant","content":"Hello"}}]}')
    assert answer_from_chunks([])["choices"][0] == {
        "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": ""}}


def test_a_whole_answer_survives_a_round_trip_through_chunks():
    answer = STAMP.answer([message_choice("round trip", "length")])
    again = answer_from_chunks(chunks_from_answer(answer))
    assert again["choices"][0]["message"] == answer["choices"][0]["message"]
    assert again["choices"][0]["finish_reason"] == "length"


def test_a_checkpoint_carries_the_text_so_far_and_counts_one_token_per_piece():
    chunk = checkpoint_chunk(["Hel", "lo", " you"])
    assert orjson.dumps(chunk) == (
        b'{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hello you"},'
        b'"finish_reason":null}],"usage":{"prompt_tokens":0,"completion_tokens":3,'
        b'"total_tokens":3}}')


def test_a_workers_embeddings_list_is_one_float_vector_per_input_in_order():
    data = embedding_list("m", [[0.5, 1.0], [-2.0]])
    assert data == {"object": "list", "model": "m", "data": [
        {"object": "embedding", "index": 0, "embedding": [0.5, 1.0]},
        {"object": "embedding", "index": 1, "embedding": [-2.0]}]}


def test_the_embeddings_answer_takes_the_clients_model_and_prompt_usage():
    result = Result(id="e", data=embedding_list("worker-name", [[0.5, -1.25, 3]]),
                    usage=Usage(prompt_tokens=4, total_tokens=4))
    answer = embeddings_answer(result, "org/embed:Q8_0", "float")
    assert orjson.dumps(answer) == (
        b'{"object":"list","model":"org/embed:Q8_0","data":[{"object":"embedding","index":0,'
        b'"embedding":[0.5,-1.25,3]}],"usage":{"prompt_tokens":4,"total_tokens":4}}')
    assert result.data["model"] == "worker-name"  # the worker's frame is left as it came


def test_base64_embeddings_are_little_endian_float32():
    result = Result(id="e", data=embedding_list("m", [[0.5, -1.25, 3.0], []]),
                    usage=Usage(prompt_tokens=2, total_tokens=2))
    answer = embeddings_answer(result, "m", "base64")
    first, empty = (item["embedding"] for item in answer["data"])
    assert struct.unpack("<3f", base64.b64decode(first)) == (0.5, -1.25, 3.0)
    assert empty == ""
    assert floats_to_base64([1.0]) == base64.b64encode(struct.pack("<f", 1.0)).decode()
    assert answer["data"][0]["index"] == 0
    assert answer["data"][0]["object"] == "embedding"


# --- every builder against openai_types and the checker ---------------------------------------


def _stamped_chunk(data: dict[str, Any]) -> dict[str, Any]:
    return STAMP.stamp(data, CHAT_CHUNK)


CHUNKS = {
    "opening": lambda: _stamped_chunk(opening_chunk("Hi")),
    "content": lambda: _stamped_chunk(content_chunk("there")),
    "finish": lambda: _stamped_chunk(finish_chunk("length")),
    "usage": lambda: _stamped_chunk(usage_chunk(usage_counts(5, 3))),
    "checkpoint": lambda: checkpoint_chunk(["a", "b"]),
    "from an answer": lambda: _stamped_chunk(
        chunks_from_answer({"choices": [{"message": {"content": "x"}}]})[0]),
}
ANSWERS = {
    "stamped": lambda: {**STAMP.answer([message_choice("Hi")]), "usage": usage_counts(5, 3)},
    "from chunks": lambda: answer_from_chunks([opening_chunk("Hi"), finish_chunk()]),
}
EMBEDDINGS = {
    "worker list": lambda: embedding_list("m", [[0.5, 1.0]]),
    "float answer": lambda: embeddings_answer(
        Result(id="e", data=embedding_list("m", [[0.5]]), usage=USAGE), "m", "float"),
    "base64 answer": lambda: embeddings_answer(
        Result(id="e", data=embedding_list("m", [[0.5]]), usage=USAGE), "m", "base64"),
}


@pytest.mark.parametrize("name", CHUNKS)
def test_every_chunk_builder_makes_a_chat_completion_chunk(name: str):
    data = CHUNKS[name]()
    chunk = ChatCompletionChunk.model_validate(data, strict=True)
    assert chunk.object == CHAT_CHUNK
    assert chunk.model_dump(exclude_unset=True) == data  # every field is one the model knows
    assert answer_problem(Chunk(id="j", seq=0, data=data)) is None


@pytest.mark.parametrize("name", ANSWERS)
def test_every_answer_builder_makes_a_chat_completion(name: str):
    data = ANSWERS[name]()
    answer = ChatCompletion.model_validate(data, strict=True)
    assert answer.object == CHAT_ANSWER
    assert answer.choices[0].message.content == "Hi"
    assert answer.model_dump(exclude_unset=True) == data
    assert answer_problem(Result(id="j", data=data, usage=USAGE)) is None


@pytest.mark.parametrize("name", EMBEDDINGS)
def test_every_embeddings_builder_makes_an_embedding_response(name: str):
    data = EMBEDDINGS[name]()
    response = EmbeddingResponse.model_validate(data, strict=True)
    assert response.data[0].index == 0
    assert response.model_dump(exclude_unset=True) == data
    if name != "base64 answer":  # workers send floats; only the queen encodes base64
        assert answer_problem(Result(id="j", data=data, usage=USAGE), embeddings=True) is None


def _chunk_with(**choice: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None, **choice}]}


def _answer_with(**choice: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                         "finish_reason": "stop", **choice}]}


BROKEN_CHUNKS = {
    "choices not a list": {"choices": {"index": 0}},
    "choice not an object": {"choices": ["x"]},
    "index not an integer": _chunk_with(index="first"),
    "finish reason not a string": _chunk_with(finish_reason=3),
    "no delta": {"choices": [{"index": 0, "finish_reason": None}]},
    "delta not an object": _chunk_with(delta="x"),
    "content not a string": _chunk_with(delta={"content": 5}),
    "role not a string": _chunk_with(delta={"role": ["assistant"]}),
    "logprobs not an object": _chunk_with(logprobs=[{"token": "x"}]),
    "logprobs content not a list": _chunk_with(logprobs={"content": "x"}),
}
BROKEN_ANSWERS = {
    "no message": {"choices": [{"index": 0, "finish_reason": "stop"}]},
    "message content not a string": _answer_with(message={"content": {"text": "x"}}),
    "index a float": _answer_with(index=0.5),
}
BROKEN_EMBEDDINGS = {
    "data not a list": {"object": "list", "data": {"0": [0.5]}},
    "item not an object": {"object": "list", "data": [[0.5]]},
    "no index": {"object": "list", "data": [{"object": "embedding", "embedding": [0.5]}]},
    "not numbers": {"object": "list", "data": [{"index": 0, "embedding": ["a"]}]},
}


def _rejects(model: type[BaseModel], data: dict[str, Any]) -> bool:
    try:
        model.model_validate(data)
    except ValidationError:
        return True
    return False


@pytest.mark.parametrize("name", BROKEN_CHUNKS)
def test_the_checker_refuses_a_chunk_the_model_refuses(name: str):
    data = BROKEN_CHUNKS[name]
    assert _rejects(ChatCompletionChunk, data)
    assert answer_problem(Chunk(id="j", seq=0, data=data)) is not None


@pytest.mark.parametrize("name", BROKEN_ANSWERS)
def test_the_checker_refuses_an_answer_the_model_refuses(name: str):
    data = BROKEN_ANSWERS[name]
    assert _rejects(ChatCompletion, data)
    assert answer_problem(Result(id="j", data=data, usage=USAGE)) is not None


@pytest.mark.parametrize("name", BROKEN_EMBEDDINGS)
def test_the_checker_refuses_embeddings_the_model_refuses(name: str):
    data = BROKEN_EMBEDDINGS[name]
    assert _rejects(EmbeddingResponse, data)
    assert answer_problem(Result(id="j", data=data, usage=USAGE), embeddings=True) is not None


def test_an_embeddings_result_must_carry_its_vectors_and_a_chat_result_need_not():
    assert answer_problem(Result(id="j", usage=USAGE), embeddings=True) == "'data' is not a list"
    assert answer_problem(Result(id="j", usage=USAGE)) is None  # a streamed answer's end


def test_the_checker_refuses_what_the_relay_cannot_encode_or_count():
    huge = Chunk(id="j", seq=0, data={**content_chunk("x"), "extra": [{"n": 2**64}]})
    assert answer_problem(huge) == "an integer in 'data' is past 64 bits"
    assert answer_problem(Chunk(id="j", seq=0, data={"n": -(2**63)})) is None
    lying = Result(id="j", usage=Usage(prompt_tokens=MAX_TOKENS + 1, total_tokens=MAX_TOKENS + 1))
    assert answer_problem(lying) == f"'usage' counts more than {MAX_TOKENS} tokens"
    flag = Chunk(id="j", seq=0, data=_chunk_with(index=True))  # JSON true is no index
    assert answer_problem(flag) == "a choice's 'index' is not an integer"


def test_a_failed_job_carries_no_payload_to_check():
    assert answer_problem(JobError(id="j", code="engine_error", message="x")) is None
