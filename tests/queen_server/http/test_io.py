"""HTTP edge helpers: parameter names, strict parsing into 400s, and the API-key check."""

from __future__ import annotations

import json
from typing import Any

import pytest

from queen_server.errors import InvalidRequest
from queen_server.http.io import param_name, parse
from shared_schema import ChatCompletionRequest, EmbeddingRequest

MESSAGES = [{"role": "user", "content": "hi"}]


def _body(**fields: Any) -> bytes:
    return json.dumps({"model": "org/repo:Q4_K_M", "messages": MESSAGES, **fields}).encode()


# --- param_name --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loc", "expected"),
    [
        (("model",), "model"),
        (("messages", 0, "role"), "messages.0.role"),
        (("stream_options", "include_usage"), "stream_options.include_usage"),
        (("body", "messages", 2, "content"), "messages.2.content"),
        (("query", "limit"), "limit"),
        (("stop", "str"), "stop"),
        (("stop", "list[str]", 1), "stop"),
        (("input", "list[list[int]]", 0, 3), "input"),
        (("messages", 0, "content", "list[dict[str,any]]", 0), "messages.0.content"),
        (("messages", 0, "content", "none"), "messages.0.content"),
        (("input", "function-after[_not_empty(), union[str,list[str]]]"), "input"),
        (("messages", 1, "body"), "messages.1.body"),
        (("body",), None),
        ((), None),
    ],
)
def test_param_name(loc, expected):
    assert param_name(loc) == expected


# --- parse -------------------------------------------------------------------------------------


def test_parse_returns_the_model_and_ignores_unknown_params():
    request = parse(ChatCompletionRequest, _body(temperature=0.5, frequency_penalty=1.0))
    assert isinstance(request, ChatCompletionRequest)
    assert request.temperature == 0.5
    assert request.messages[0].content == "hi"


@pytest.mark.parametrize("body", [b"", b"{", b'{"model": "m",}', b"not json at all"])
def test_parse_broken_json(body):
    with pytest.raises(InvalidRequest) as info:
        parse(ChatCompletionRequest, body)
    assert info.value.code == "invalid_json"
    assert info.value.param is None
    assert info.value.status_code == 400
    assert info.value.body().error.type == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"messages": [{"role": "user", "content": "hi"}]}', "model"),
        (b'{"model": "m"}', "messages"),
        (b'{"model": "m", "messages": [{"content": "hi"}]}', "messages.0.role"),
    ],
)
def test_parse_missing_field(body, param):
    with pytest.raises(InvalidRequest) as info:
        parse(ChatCompletionRequest, body)
    assert info.value.code == "missing_required_parameter"
    assert info.value.param == param
    assert f"'{param}'" in info.value.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_body(temperature=3), "temperature"),
        (_body(n=0), "n"),
        (_body(stop=["a", "b", "c", "d", "e"]), "stop"),
        (_body(stop=5), "stop"),
        (_body(messages=[]), "messages"),
        (_body(messages=[{"role": "robot", "content": "x"}]), "messages.0.role"),
        (_body(stream_options={"include_usage": "maybe"}), "stream_options.include_usage"),
        (_body(max_tokens=0), "max_tokens"),
    ],
)
def test_parse_bad_value(body, param):
    with pytest.raises(InvalidRequest) as info:
        parse(ChatCompletionRequest, body)
    assert info.value.code == "invalid_value"
    assert info.value.param == param
    rendered = info.value.body().error
    assert rendered.param == param
    assert rendered.code == "invalid_value"


def test_parse_bad_embedding_input_names_input():
    with pytest.raises(InvalidRequest) as info:
        parse(EmbeddingRequest, b'{"model": "m", "input": []}')
    assert info.value.param == "input"
    assert info.value.code == "invalid_value"
    with pytest.raises(InvalidRequest) as mixed:
        parse(EmbeddingRequest, b'{"model": "m", "input": [1.5]}')
    assert mixed.value.param == "input"


def test_parse_a_body_that_is_not_an_object():
    with pytest.raises(InvalidRequest) as info:
        parse(ChatCompletionRequest, b"[1, 2]")
    assert info.value.code == "invalid_value"
    assert info.value.param is None
    assert "the request body" in info.value.message
