"""The one list of OpenAI request fields, walked: against the installed ``openai`` SDK's own
parameter lists (a field OpenAI adds fails here until it is honoured or refused), against the
request models (each honoured field held, each refused one rejected), and through the queen's
parser (a refused field is a 400 naming it, with its reason)."""

from __future__ import annotations

import orjson
import pytest
from openai.types import completion_create_params, embedding_create_params, image_generate_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params
from pydantic import BaseModel

from queen_server.errors import InvalidRequest
from queen_server.http.io import parse
from shared_schema.images import ImageGenerationRequest
from shared_schema.openai_fields import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    IMAGES,
    RESPONSES,
    FieldRule,
)
from shared_schema.openai_requests import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from shared_schema.responses import ResponsesRequest

ENDPOINTS: list[tuple[str, dict[str, FieldRule], type[BaseModel], set[str]]] = [
    ("chat", CHAT, ChatCompletionRequest,
     {*chat_create_params.CompletionCreateParamsBase.__annotations__, "stream"}),
    ("completions", COMPLETIONS, CompletionRequest,
     {*completion_create_params.CompletionCreateParamsBase.__annotations__, "stream"}),
    ("embeddings", EMBEDDINGS, EmbeddingRequest,
     set(embedding_create_params.EmbeddingCreateParams.__annotations__)),
    ("responses", RESPONSES, ResponsesRequest,
     {*response_create_params.ResponseCreateParamsBase.__annotations__, "stream"}),
    ("images", IMAGES, ImageGenerationRequest,
     {*image_generate_params.ImageGenerateParamsBase.__annotations__, "stream"}),
]
MINIMAL = {
    "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "completions": {"model": "m", "prompt": "hi"},
    "embeddings": {"model": "m", "input": "hi"},
    "responses": {"model": "m", "input": "hi"},
    "images": {"model": "m", "prompt": "a hive at dawn"},
}
IDS = [endpoint[0] for endpoint in ENDPOINTS]


@pytest.mark.parametrize(("name", "fields", "model", "sdk"), ENDPOINTS, ids=IDS)
def test_every_field_the_sdk_sends_is_in_the_list(name, fields, model, sdk):
    missing = sdk - fields.keys()
    assert not missing, f"{name}: the openai SDK has fields the list does not say: {missing}"


@pytest.mark.parametrize(("name", "fields", "model", "sdk"), ENDPOINTS, ids=IDS)
def test_the_model_holds_exactly_the_fields_not_refused(name, fields, model, sdk):
    held = {field.alias or key for key, field in model.model_fields.items()}
    accepted = {key for key, rule in fields.items() if rule.kind != "refused"}
    assert held == accepted
    for rule in fields.values():
        assert rule.kind in {"honoured", "no_effect", "only", "refused"}
        assert rule.kind == "honoured" or rule.note, "a field not plainly honoured says why"


@pytest.mark.parametrize(("name", "fields", "model", "sdk"), ENDPOINTS, ids=IDS)
def test_a_refused_field_is_a_400_naming_it_with_the_reason(name, fields, model, sdk):
    for key, rule in fields.items():
        if rule.kind != "refused":
            continue
        body = orjson.dumps({**MINIMAL[name], key: "anything"})
        with pytest.raises(InvalidRequest) as caught:
            parse(model, body, fields)
        assert caught.value.param == key
        assert caught.value.code == "unsupported_parameter"
        assert rule.note in caught.value.message


@pytest.mark.parametrize(("name", "fields", "model", "sdk"), ENDPOINTS, ids=IDS)
def test_a_field_openai_does_not_define_is_unrecognised(name, fields, model, sdk):
    with pytest.raises(InvalidRequest) as caught:
        parse(model, orjson.dumps({**MINIMAL[name], "frobnicate": 1}), fields)
    assert caught.value.param == "frobnicate"
    assert caught.value.code == "unknown_parameter"
    assert caught.value.message == "Unrecognized request argument supplied: frobnicate"


def test_a_nested_unknown_field_is_named_by_its_path():
    body = {**MINIMAL["chat"], "messages": [{"role": "user", "content": "hi", "mood": "x"}]}
    with pytest.raises(InvalidRequest) as caught:
        parse(ChatCompletionRequest, orjson.dumps(body), CHAT)
    assert caught.value.param == "messages.0.mood"


@pytest.mark.parametrize(("field", "value"), [
    ("store", True), ("service_tier", "priority"), ("modalities", ["text", "audio"])])
def test_a_field_accepted_with_one_value_refuses_the_others(field, value):
    with pytest.raises(InvalidRequest) as caught:
        parse(ChatCompletionRequest, orjson.dumps({**MINIMAL["chat"], field: value}), CHAT)
    assert caught.value.param is not None
    assert caught.value.param.startswith(field)
    parse(ChatCompletionRequest, orjson.dumps({**MINIMAL["chat"], "store": False,
                                               "service_tier": "auto",
                                               "modalities": ["text"]}), CHAT)


@pytest.mark.parametrize(("patch", "param"), [
    ({"n": 0}, "n"),
    ({"n": 9}, "n"),
    ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, None),  # top_logprobs without logprobs
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools.0.function.parameters"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": 3}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "https://example.com/s.json"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tool_choice": {"type": "function", "function": {"name": "g"}},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content"),
    ({"messages": [{"role": "tool", "content": "42"}]}, None),  # no tool_call_id
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
])
def test_bad_values_of_the_new_fields_are_400s_naming_them(patch, param):
    with pytest.raises(InvalidRequest) as caught:
        parse(ChatCompletionRequest, orjson.dumps({**MINIMAL["chat"], **patch}), CHAT)
    if param is not None:
        assert caught.value.param is not None
        assert caught.value.param.startswith(param)
    assert caught.value.code in {"invalid_value", "missing_required_parameter"}


def test_the_sdk_echoing_an_answer_message_back_is_accepted():
    """``messages.append(completion.choices[0].message)`` sends its empty fields back."""
    body = {**MINIMAL["chat"], "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "refusal": None, "function_call": None,
         "audio": None, "annotations": [],
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]}
    request = parse(ChatCompletionRequest, orjson.dumps(body), CHAT)
    assert request.messages[1].tool_calls is not None
