"""The OpenAI API shapes: requests are range-checked, answers accept what OpenAI sends."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from shared_schema import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    ModelAvailability,
    ModelCard,
    ModelList,
    Usage,
)

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello!"},
]


def _chat(**overrides: Any) -> dict[str, Any]:
    return {"model": "org/repo:Q4_K_M", "messages": MESSAGES, **overrides}


def test_chat_request_accepts_a_typical_sdk_body():
    body = {
        "model": "org/repo:Q4_K_M",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "ann"},
            {"role": "assistant", "content": None},
            {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 64,
        "max_completion_tokens": 64,
        "temperature": 0.7,
        "top_p": 0.9,
        "stop": ["\n\n", "END"],
        "seed": 7,
        "n": 1,
        "user": "user-123",
    }
    request = ChatCompletionRequest.model_validate(body)
    assert request.stream is True
    assert request.stream_options is not None
    assert request.stream_options.include_usage is True
    assert request.temperature == 0.7
    assert request.stop == ["\n\n", "END"]
    assert [m.role for m in request.messages] == ["developer", "user", "assistant", "tool"]
    assert request.model_dump(exclude_unset=True)["messages"][1]["content"] == [
        {"type": "text", "text": "Hi"}]
    assert request.model_dump(exclude_unset=True) == body


def test_chat_request_holds_the_sampling_and_tool_fields_and_refuses_others():
    body = _chat(
        frequency_penalty=0.5,
        presence_penalty=0.1,
        logit_bias={"50256": -100},
        response_format={"type": "text"},
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        parallel_tool_calls=False,
    )
    body["messages"] = [{**MESSAGES[1], "refusal": None}]
    request = ChatCompletionRequest.model_validate(body)
    assert request.frequency_penalty == 0.5
    assert request.logit_bias == {"50256": -100}
    assert request.tools is not None
    assert request.tools[0].function.name == "f"
    # A field the queen does not honour is refused (shared_schema.openai_fields says why).
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**body, "metadata": {"a": "b"}})


def test_chat_request_defaults():
    request = ChatCompletionRequest.model_validate(_chat())
    assert request.stream is False
    assert request.n is None
    assert request.choices == 1
    assert request.stop is None
    assert request.temperature is None


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": 9}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"temperature": 3}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "beep"}]}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({"model": ""}, "model"),
    ],
)
def test_chat_request_rejects_bad_values(overrides, field):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(_chat(**overrides), extra="ignore")
    assert info.value.errors()[0]["loc"][0] == field


def test_chat_request_allows_up_to_four_stops_and_a_single_string():
    assert ChatCompletionRequest.model_validate(_chat(stop=["a", "b", "c", "d"])).stop == [
        "a", "b", "c", "d",
    ]
    assert ChatCompletionRequest.model_validate(_chat(stop="###")).stop == "###"
    assert ChatCompletionRequest.model_validate(_chat(temperature=2)).temperature == 2


@pytest.mark.parametrize(
    "value",
    ["one text", ["two", "texts"], [1, 2, 3], [[1, 2], [3]]],
    ids=["str", "list-str", "tokens", "token-lists"],
)
def test_embedding_request_accepts_every_input_shape(value):
    request = EmbeddingRequest.model_validate({"model": "m", "input": value})
    assert request.input == value
    assert request.encoding_format == "float"


@pytest.mark.parametrize("value", [[], {"text": "x"}, [1.5], None])
def test_embedding_request_rejects_bad_input(value):
    with pytest.raises(ValidationError) as info:
        EmbeddingRequest.model_validate({"model": "m", "input": value})
    assert info.value.errors()[0]["loc"][0] == "input"


def test_embedding_request_checks_its_options():
    with pytest.raises(ValidationError):
        EmbeddingRequest.model_validate({"model": "m", "input": "x", "encoding_format": "hex"})
    with pytest.raises(ValidationError):  # refused: vectors come in the model's own size
        EmbeddingRequest.model_validate({"model": "m", "input": "x", "dimensions": 256})
    ok = EmbeddingRequest.model_validate({"model": "m", "input": "x", "encoding_format": "base64"})
    assert ok.encoding_format == "base64"


OPENAI_COMPLETION = {
    "id": "chatcmpl-abc123",
    "object": "chat.completion",
    "created": 1700000000,
    "model": "gpt-4o-mini-2024-07-18",
    "system_fingerprint": "fp_44709d6fcb",
    "choices": [{
        "index": 0,
        "message": {"role": "assistant", "content": "Hello there!", "refusal": None},
        "logprobs": None,
        "finish_reason": "stop",
    }],
    "usage": {
        "prompt_tokens": 9,
        "completion_tokens": 3,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 0},
    },
}


def test_chat_completion_accepts_an_openai_answer_and_keeps_its_extras():
    answer = ChatCompletion.model_validate(OPENAI_COMPLETION, extra="ignore")
    assert answer.id == "chatcmpl-abc123"
    assert answer.choices[0].message.content == "Hello there!"
    assert answer.usage.model_dump() == {"prompt_tokens": 9, "completion_tokens": 3,
                                         "total_tokens": 12}
    # Lenient models keep the fields they do not know, so a relayed answer loses nothing.
    kept = ChatCompletion.model_validate({k: v for k, v in OPENAI_COMPLETION.items()
                                          if k != "usage"})
    dumped = kept.model_dump()
    assert dumped["system_fingerprint"] == "fp_44709d6fcb"
    assert dumped["choices"][0]["logprobs"] is None
    assert dumped["choices"][0]["message"]["refusal"] is None


def test_chat_completion_needs_a_choice():
    with pytest.raises(ValidationError):
        ChatCompletion.model_validate({"choices": []})
    with pytest.raises(ValidationError):
        ChatCompletion.model_validate({"object": "chat.completion.chunk", "choices": [
            {"message": {"role": "assistant", "content": "x"}}]})


@pytest.mark.parametrize(
    "payload",
    [
        {
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000,
            "model": "m", "system_fingerprint": "fp",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}],
        },
        {
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000,
            "model": "m",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        },
        {
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000,
            "model": "m", "choices": [],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
        },
    ],
    ids=["first", "last", "usage"],
)
def test_chat_completion_chunk_accepts_openai_chunks(payload):
    chunk = ChatCompletionChunk.model_validate(payload, extra="ignore")
    assert chunk.id == "chatcmpl-1"
    assert chunk.object == "chat.completion.chunk"
    if payload["choices"]:
        assert chunk.choices[0].finish_reason == payload["choices"][0]["finish_reason"]
        assert chunk.choices[0].delta.content == payload["choices"][0]["delta"].get("content")
    else:
        assert chunk.usage.model_dump() == Usage(**payload["usage"]).model_dump()


def test_embedding_response_accepts_an_openai_answer():
    payload = {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": [0.1, -0.2, 0.3]},
            {"object": "embedding", "index": 1, "embedding": "AAAAAA=="},
        ],
        "model": "text-embedding-3-small",
        "usage": {"prompt_tokens": 8, "total_tokens": 8},
    }
    response = EmbeddingResponse.model_validate(payload)
    assert response.data[0].embedding == [0.1, -0.2, 0.3]
    assert response.data[1].embedding == "AAAAAA=="
    assert response.usage.prompt_tokens == 8
    assert response.model_dump() == payload


def test_model_list_and_error_shapes():
    listing = ModelList(data=[ModelCard(
        id="org/repo:Q4_K_M", created=1700000000,
        apiary=ModelAvailability(workers=3, loaded_on=1, parameter_count=7_000_000_000),
    )])
    dumped = listing.model_dump()
    assert dumped["object"] == "list"
    assert dumped["data"][0]["object"] == "model"
    assert dumped["data"][0]["owned_by"] == "apiary"
    assert dumped["data"][0]["apiary"]["workers"] == 3
    error = ErrorResponse.model_validate({"error": {
        "message": "bad", "type": "invalid_request_error", "param": "n", "code": "invalid_value",
    }})
    assert error.error.param == "n"
    with pytest.raises(ValidationError):
        ModelAvailability(workers=-1, loaded_on=0)


def test_answer_usage_keeps_openai_usage_details():
    body = {**OPENAI_COMPLETION, "usage": {"prompt_tokens": 9, "completion_tokens": 3,
                                           "total_tokens": 12,
                                           "prompt_tokens_details": {"cached_tokens": 0}}}
    answer = ChatCompletion.model_validate(body)
    assert answer.usage.model_extra == {"prompt_tokens_details": {"cached_tokens": 0}}
