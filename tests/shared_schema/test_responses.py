"""The Responses API request body: what it holds, what it refuses, and how a refusal is named.

The fields are walked against ``openai_fields.RESPONSES``; the bodies the openai SDK itself
sends (captured through an ``httpx.MockTransport``) must be accepted as they are; every bad
value must fail with the 400 ``param`` the queen's parser would name (``validation_error``).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage
from pydantic import ValidationError

from queen_server.http.io import validation_error
from shared_schema.openai_fields import RESPONSES
from shared_schema.responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputMessage,
    ResponsesRequest,
)

BASE: dict[str, Any] = {"model": "smollm2", "input": "hi"}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False},
           "strict": True}

# One value the queen serves for every field it does not refuse.
SAMPLES: dict[str, Any] = {
    "model": "smollm2",
    "input": [{"role": "user", "content": "What is the weather in Paris?"}],
    "instructions": "Answer briefly.",
    "max_output_tokens": 100,
    "temperature": 0.7,
    "top_p": 0.9,
    "stream": True,
    "stream_options": {"include_obfuscation": False},
    "tools": [WEATHER],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "text": {"format": {"type": "text"}},
    "user": "user-1",
    "safety_identifier": "hash-1",
    "prompt_cache_key": "conv-1",
    "store": False,
    "service_tier": "auto",
    "truncation": "disabled",
    "include": [],
}
REFUSED_SAMPLES: dict[str, Any] = {
    "metadata": {"k": "v"}, "previous_response_id": "resp_1", "conversation": "conv_1",
    "background": True, "background_options": {}, "reasoning": {"effort": "low"},
    "top_logprobs": 2, "max_tool_calls": 3, "prompt": {"id": "pmpt_1"},
    "context_management": [], "moderation": {"model": "omni"}, "access_programs": {},
    "image": {}, "prompt_cache_retention": "24h", "prompt_cache_options": {},
}


def param_of(body: dict[str, Any]) -> tuple[str | None, str]:
    """The ``param`` and message of the 400 the queen would answer ``body`` with."""
    with pytest.raises(ValidationError) as caught:
        ResponsesRequest.model_validate(body)
    error = validation_error(caught.value, RESPONSES)
    return error.param, str(error)


def test_the_model_holds_exactly_the_fields_not_refused() -> None:
    served = {name for name, rule in RESPONSES.items() if rule.kind != "refused"}
    fields = {info.alias or name for name, info in ResponsesRequest.model_fields.items()}
    assert fields == served
    assert set(SAMPLES) == served


def test_every_served_field_is_accepted_together() -> None:
    req = ResponsesRequest.model_validate(SAMPLES)
    assert req.stream is True
    assert req.store is False
    assert req.truncation == "disabled"
    assert req.function_tools[0].name == "get_weather"


@pytest.mark.parametrize("name", sorted(n for n, r in RESPONSES.items() if r.kind == "refused"))
def test_every_refused_field_is_refused_by_name(name: str) -> None:
    assert set(REFUSED_SAMPLES) == {n for n, r in RESPONSES.items() if r.kind == "refused"}
    with pytest.raises(ValidationError) as caught:
        ResponsesRequest.model_validate({**BASE, name: REFUSED_SAMPLES[name]})
    assert [(e["loc"], e["type"]) for e in caught.value.errors()] == [
        ((name,), "extra_forbidden")]
    error = validation_error(caught.value, RESPONSES)
    assert error.param == name
    assert "not supported" in str(error)
    assert RESPONSES[name].note in str(error)


def test_a_string_input_is_one_user_message() -> None:
    items = ResponsesRequest.model_validate(BASE).items
    assert items == [InputMessage(role="user", content="hi")]


def captured_body(**params: Any) -> dict[str, Any]:
    """The JSON body the openai SDK sends for ``client.responses.create(**params)``."""
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(400, json={"error": {"message": "captured", "type": "x"}})

    client = openai.OpenAI(api_key="sk-test", base_url="http://queen.test/v1", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**params)
    return bodies[0]


def test_the_sdks_own_bodies_are_accepted() -> None:
    body = captured_body(
        model="smollm2", instructions="Be brief.", max_output_tokens=64, temperature=0.3,
        top_p=0.95, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False, store=False, truncation="disabled", include=[],
        user="u", safety_identifier="s", prompt_cache_key="p", service_tier="default",
        input=[
            {"role": "system", "content": "You are a weather bot."},
            {"role": "developer", "content": [{"type": "input_text", "text": "Use Celsius."}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": [],
                          "logprobs": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1",
             "name": "get_weather", "arguments": '{"city": "Paris"}', "status": "completed"},
            {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
        ])
    req = ResponsesRequest.model_validate(body)
    assert [type(item) for item in req.items] == [
        InputMessage, InputMessage, InputMessage, InputMessage, FunctionCallItem,
        FunctionCallOutputItem]
    assert isinstance(req.function_tools[0], FunctionTool)

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    structured = captured_body(model="smollm2", input="Give me a", stream=True, text={
        "format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}})
    req = ResponsesRequest.model_validate(structured)
    assert req.stream
    assert req.text is not None
    assert req.text.format.schema_ == schema
    assert ResponsesRequest.model_validate(captured_body(
        model="m", input="x", text={"format": {"type": "json_object"}}))


def test_items_passed_back_by_model_dump_are_accepted() -> None:
    """``item.model_dump()`` (as scripts often pass an earlier output back) carries the SDK's
    unset optional fields as nulls, and ``async_`` under its Python name."""
    body = captured_body(model="m", tools=[WEATHER], input=[
        {"role": "user", "content": "Weather?"},
        ResponseFunctionToolCall(type="function_call", call_id="call_1", name="get_weather",
                                 arguments='{"city": "Oslo"}', id="fc_1",
                                 status="completed").model_dump(),
        ResponseOutputMessage(id="msg_1", type="message", role="assistant", status="completed",
                              content=[{"type": "output_text", "text": "Snow.",
                                        "annotations": [], "logprobs": []}]).model_dump(),
        {"type": "function_call_output", "call_id": "call_1", "output": "Snow.",
         "name": "get_weather", "caller": {"type": "direct"}, "namespace": None}])
    assert {"async_", "caller", "namespace"} <= set(body["input"][1])
    req = ResponsesRequest.model_validate(body)
    assert isinstance(req.items[1], FunctionCallItem)
    assert req.items[1].call_id == "call_1"


# --- bad input, each named ----------------------------------------------------------------------

BAD: list[tuple[str, dict[str, Any], str | None, str]] = [
    ("a tool with no name", {"tools": [{"type": "function", "parameters": {}}]},
     "tools.0.name", "Field required"),
    ("a built-in tool", {"tools": [WEATHER, {"type": "web_search"}]},
     "tools.1.type", "only 'function' tools"),
    ("a tool of no type", {"tools": [{"name": "f"}]}, "tools.0.type", "Field required"),
    ("a tool whose parameters are not JSON Schema",
     {"tools": [{**WEATHER, "parameters": {"type": "objekt"}}]},
     "tools.0.parameters", "not a valid JSON Schema"),
    ("a tool with a bad name", {"tools": [{**WEATHER, "name": "get weather"}]},
     "tools.0.name", "pattern"),
    ("a tool field the queen does not serve", {"tools": [{**WEATHER, "defer_loading": True}]},
     "tools.0.defer_loading", "Unrecognized"),
    ("a json_schema that is not JSON Schema",
     {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 12}}}},
     "text.format.schema", "not a valid JSON Schema"),
    ("a json_schema whose $ref leaves the schema",
     {"text": {"format": {"type": "json_schema", "name": "x",
                          "schema": {"$ref": "https://example.com/s.json"}}}},
     "text.format.schema", "'$ref' may only point inside"),
    ("a json_schema with no name", {"text": {"format": {"type": "json_schema", "schema": {}}}},
     "text.format.name", "Field required"),
    ("an unknown text format", {"text": {"format": {"type": "grammar", "grammar": "x"}}},
     "text.format.type", "not a text format"),
    ("a verbosity", {"text": {"verbosity": "low"}}, "text.verbosity", "None"),
    ("a function_call_output with no call_id",
     {"input": [{"type": "function_call_output", "output": "21 C"}]},
     "input.0.call_id", "Field required"),
    ("a function_call_output with an empty call_id",
     {"input": [{"role": "user", "content": "x"},
                {"type": "function_call_output", "call_id": "", "output": "21 C"}]},
     "input.1.call_id", "at least 1"),
    ("a function_call with no arguments",
     {"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
     "input.0.arguments", "Field required"),
    ("an image input part",
     {"input": [{"role": "user", "content": [
         {"type": "input_text", "text": "What is this?"},
         {"type": "input_image", "image_url": "https://example.com/cat.png"}]}]},
     "input.0.content.1.type", "workers read text only"),
    ("a file input part",
     {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input.0.content.0.type", "workers read text only"),
    ("a refusal passed back",
     {"input": [{"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]},
     "input.0.content.0.type", "workers read text only"),
    ("an annotated text passed back",
     {"input": [{"role": "assistant", "content": [
         {"type": "output_text", "text": "x", "annotations": [{"type": "file_path"}]}]}]},
     "input.0.content.0.annotations", "at most 0"),
    ("an item type the queen does not serve",
     {"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]},
     "input.0.type", "items are not supported"),
    ("a call made by a program",
     {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}",
                 "caller": {"type": "program", "caller_id": "p"}}]},
     "input.0.caller.type", "'direct'"),
    ("a call in a namespace",
     {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}",
                 "namespace": "ns"}]},
     "input.0.namespace", "None"),
    ("an asynchronous call",
     {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}",
                 "async": True}]},
     "input.0.async", "False"),
    ("a message of an unknown role", {"input": [{"role": "tool", "content": "x"}]},
     "input.0.role", "Input should be"),
    ("an empty input list", {"input": []}, "input", "at least 1"),
    ("no input", {"input": None}, "input", "valid list"),
    ("store true", {"store": True}, "store", "False"),
    ("truncation auto", {"truncation": "auto"}, "truncation", "'disabled'"),
    ("extra output data", {"include": ["message.output_text.logprobs"]}, "include", "at most 0"),
    ("another service tier", {"service_tier": "flex"}, "service_tier", "'auto' or 'default'"),
    ("max_output_tokens 0", {"max_output_tokens": 0}, "max_output_tokens", "greater than"),
    ("temperature past 2", {"temperature": 2.5}, "temperature", "less than"),
    ("an unknown tool choice mode", {"tool_choice": "sometimes"}, "tool_choice", "'auto'"),
    ("a hosted tool choice", {"tool_choice": {"type": "file_search"}}, "tool_choice.type",
     "tool choice is not supported"),
    ("a tool choice naming no tool",
     {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_time"}},
     None, "not one of the tools"),
    ("required with no tools", {"tool_choice": "required"}, None, "needs at least one tool"),
    ("two tools of one name", {"tools": [WEATHER, WEATHER]}, None, "same name"),
    ("a json format with tools",
     {"tools": [WEATHER], "text": {"format": {"type": "json_object"}}}, None,
     "cannot be combined with 'tools'"),
    ("an unknown field", {"frobnicate": 1}, "frobnicate", "Unrecognized request argument"),
]


@pytest.mark.parametrize(("body", "param", "words"), [case[1:] for case in BAD],
                         ids=[case[0] for case in BAD])
def test_bad_input_fails_naming_the_field(body: dict[str, Any], param: str | None,
                                          words: str) -> None:
    got_param, message = param_of({**BASE, **body})
    assert got_param == param
    assert words in message
