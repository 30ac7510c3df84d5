"""The Responses API shaper, held to the openai SDK's own types and its own stream reader.

Whole answers must pass ``Response.model_validate``; every streamed event must parse as the
SDK's ``ResponseStreamEvent`` union; and the stream, served through an ``httpx.MockTransport``
to a real ``openai.OpenAI`` client, must give ``client.responses.stream()`` the final response
with the right text and calls (its ``ResponseStreamState`` accumulates the events), and make
the client raise when the stream fails.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from queen_server.shaping.base import Event
from queen_server.shaping.responses import (
    ResponsesShaper,
    chat_messages,
    chat_request,
    new_response_id,
    response_usage,
)
from shared_schema.answers import chat_chunk, content_chunk, delta_choice, finish_chunk
from shared_schema.responses import ResponsesRequest

EVENTS = TypeAdapter(ResponseStreamEvent)
USAGE = {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}, "strict": True},
         {"type": "function", "name": "get_time", "parameters": {"type": "object"}}]


def shaper(**body: Any) -> ResponsesShaper:
    req = ResponsesRequest.model_validate({"model": "smollm2", "input": "hi", **body})
    return ResponsesShaper(req, "resp_test1", 1_700_000_000, clock=lambda: 1_700_000_005.0)


def answer(content: str | None, finish: str = "stop",
           tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "smollm2",
            "choices": [{"index": 0, "message": message, "finish_reason": finish,
                         "logprobs": None}],
            "usage": USAGE}


def call(index: int, call_id: str, name: str | None = None, arguments: str = "",
         ) -> dict[str, Any]:
    """A chat tool-call delta: the first (with id and name) or an arguments fragment."""
    if name is not None:
        return {"index": index, "id": call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}}
    return {"index": index, "function": {"arguments": arguments}}


def text_chunks(*pieces: str, finish: str = "stop") -> list[dict[str, Any]]:
    first = chat_chunk([delta_choice({"role": "assistant", "content": ""})])
    return [first, *(content_chunk(piece) for piece in pieces), finish_chunk(finish)]


def call_chunks(*deltas: dict[str, Any]) -> list[dict[str, Any]]:
    return [chat_chunk([delta_choice({"role": "assistant", "tool_calls": [delta]})])
            for delta in deltas] + [finish_chunk("tool_calls")]


def stream(s: ResponsesShaper, chunks: list[dict[str, Any]],
           usage: dict[str, int] | None = USAGE, error: dict[str, Any] | None = None,
           ) -> list[Event]:
    events = s.opening()
    for chunk in chunks:
        events += s.chunk(chunk)
    events += s.failed(error) if error is not None else s.closing(usage or USAGE)
    return events


def check_events(events: list[Event]) -> list[Any]:
    """Every event is one of the SDK's, named as its ``type``, numbered 0, 1, 2..."""
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    parsed = []
    for name, data in events:
        assert name == data["type"]
        event = EVENTS.validate_python(data)
        assert event.type == name
        parsed.append(event)
    return parsed


def sse(events: list[Event]) -> bytes:
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
                    for name, data in events)


def sdk_client(serve: Callable[[dict[str, Any]], httpx.Response]) -> openai.OpenAI:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/responses"
        return serve(json.loads(request.content))

    return openai.OpenAI(api_key="sk-test", base_url="http://queen.test/v1", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handler)))


def streamed_by(chunks: list[dict[str, Any]], error: dict[str, Any] | None = None,
                ) -> Callable[[dict[str, Any]], httpx.Response]:
    """A stand-in for the queen's route: the SDK's body parsed and translated as the route
    does, the scripted chat chunks shaped into the SSE body."""

    def serve(body: dict[str, Any]) -> httpx.Response:
        req = ResponsesRequest.model_validate(body)
        assert chat_request(req).stream
        events = stream(ResponsesShaper(req, "resp_sdk", 1_700_000_000), chunks, error=error)
        return httpx.Response(200, content=sse(events),
                              headers={"content-type": "text/event-stream"})

    return serve


# --- whole answers ------------------------------------------------------------------------------


def test_whole_text_answer_is_a_completed_response_the_sdk_validates() -> None:
    data = shaper(instructions="Be brief.", max_output_tokens=50).whole(answer("Hello there"))
    response = Response.model_validate(data)
    assert response.id == "resp_test1"
    assert response.status == "completed"
    assert response.output_text == "Hello there"
    assert [item.type for item in response.output] == ["message"]
    assert response.output[0].status == "completed"
    assert response.instructions == "Be brief."
    assert response.max_output_tokens == 50
    assert response.completed_at == 1_700_000_005.0
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens,
            response.usage.total_tokens) == (12, 5, 17)
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert response.usage.output_tokens_details.reasoning_tokens == 0


def test_an_answer_cut_off_by_the_limit_is_incomplete() -> None:
    response = Response.model_validate(shaper().whole(answer("Hello th", finish="length")))
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"
    assert response.output_text == "Hello th"


def test_whole_tool_calls_are_function_call_items() -> None:
    calls = [{"id": "call_a", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_b", "type": "function",
              "function": {"name": "get_time", "arguments": "{}"}}]
    data = shaper(tools=TOOLS).whole(answer(None, "tool_calls", calls))
    response = Response.model_validate(data)
    assert response.status == "completed"
    assert [(item.type, item.call_id, item.name, item.arguments, item.status)
            for item in response.output] == [
        ("function_call", "call_a", "get_weather", '{"city": "Paris"}', "completed"),
        ("function_call", "call_b", "get_time", "{}", "completed")]
    ids = [item.id for item in response.output]
    assert all(i and i.startswith("fc_") for i in ids)
    assert len(set(ids)) == 2
    assert [tool.name for tool in response.tools] == ["get_weather", "get_time"]
    assert response.output_text == ""


def test_prose_before_a_call_is_a_message_then_the_call() -> None:
    calls = [{"id": "call_a", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    response = Response.model_validate(
        shaper(tools=TOOLS).whole(answer("Let me look.", "tool_calls", calls)))
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert response.output_text == "Let me look."


def test_the_response_echoes_the_request_settings() -> None:
    fmt = {"type": "json_schema", "name": "answer", "strict": True,
           "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    data = shaper(text={"format": fmt}, temperature=0.2, top_p=0.9, parallel_tool_calls=False,
                  user="u1").whole(answer('{"a": 1}'))
    response = Response.model_validate(data)
    assert response.text is not None
    assert response.text.format is not None
    assert response.text.format.model_dump(by_alias=True, exclude_none=True) == fmt
    assert (response.temperature, response.top_p, response.parallel_tool_calls) == (
        0.2, 0.9, False)
    assert response.user == "u1"
    assert response.tool_choice == "auto"
    named = shaper(tools=TOOLS, tool_choice={"type": "function", "name": "get_time"})
    echoed = Response.model_validate(named.whole(answer(None, "tool_calls", [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}])))
    assert echoed.tool_choice.model_dump() == {"type": "function", "name": "get_time"}


def test_an_empty_answer_is_one_empty_message() -> None:
    response = Response.model_validate(shaper().whole(answer("")))
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == ""


def test_only_choice_zero_is_read_and_the_stream_ends_without_done() -> None:
    s = shaper()
    assert s.sse_done is False
    data = s.whole({**answer("zero"), "choices": [
        {"index": 1, "message": {"role": "assistant", "content": "one"},
         "finish_reason": "stop"},
        {"index": 0, "message": {"role": "assistant", "content": "zero"},
         "finish_reason": "stop"}]})
    assert Response.model_validate(data).output_text == "zero"
    events = stream(shaper(), [content_chunk("a"), content_chunk("IGNORED", index=1),
                               finish_chunk()])
    check_events(events)
    assert events[-1][1]["response"]["output"][0]["content"][0]["text"] == "a"


def test_usage_in_the_responses_names() -> None:
    assert response_usage(None) is None
    assert response_usage({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}) == {
        "input_tokens": 3, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 4, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 7}


# --- streams ------------------------------------------------------------------------------------


def test_a_text_stream_is_the_sdks_event_sequence() -> None:
    events = stream(shaper(), text_chunks("Hel", "lo ", "wörld"))
    parsed = check_events(events)
    assert [event.type for event in parsed] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    item_id = parsed[2].item.id
    assert item_id.startswith("msg_")
    assert {event.item_id for event in parsed[3:9]} == {item_id}
    assert {event.output_index for event in parsed[2:10]} == {0}
    assert [event.delta for event in parsed[4:7]] == ["Hel", "lo ", "wörld"]
    assert parsed[7].text == "Hello wörld"
    assert parsed[0].response.status == "in_progress"
    assert parsed[0].response.output == []
    final = parsed[-1].response
    assert final.status == "completed"
    assert final.output_text == "Hello wörld"
    assert final.usage is not None
    assert final.usage.total_tokens == 17


def test_the_sdks_stream_reader_gives_the_final_text() -> None:
    client = sdk_client(streamed_by(text_chunks("The sky ", "is ", "blue.")))
    with client.responses.stream(model="smollm2", input="Colour of the sky?") as events:
        deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
        final = events.get_final_response()
    assert deltas == ["The sky ", "is ", "blue."]
    assert final.output_text == "The sky is blue."
    assert final.status == "completed"
    assert final.usage is not None
    assert final.usage.output_tokens == 5


def test_streamed_calls_reach_the_sdk_as_function_calls() -> None:
    chunks = call_chunks(call(0, "call_w", "get_weather"), call(0, "", None, '{"ci'),
                         call(0, "", None, 'ty": "Pa'), call(0, "", None, 'ris"}'),
                         call(1, "call_t", "get_time", ""), call(1, "", None, "{}"))
    events = stream(shaper(tools=TOOLS), chunks)
    parsed = check_events(events)
    added = [event for event in parsed if event.type == "response.output_item.added"]
    assert [(event.output_index, event.item.type) for event in added] == [
        (0, "function_call"), (1, "function_call")]
    done = [event for event in parsed if event.type == "response.function_call_arguments.done"]
    assert [event.arguments for event in done] == ['{"city": "Paris"}', "{}"]
    # The first call is finished before the second begins, as OpenAI streams them.
    types = [event.type for event in parsed]
    assert types.index("response.output_item.done") < [
        i for i, t in enumerate(types) if t == "response.output_item.added"][1]

    client = sdk_client(streamed_by(chunks))
    with client.responses.stream(model="smollm2", input="Weather in Paris?",
                                 tools=TOOLS) as reader:
        arg_deltas = [event.delta for event in reader
                      if event.type == "response.function_call_arguments.delta"]
        final = reader.get_final_response()
    assert "".join(arg_deltas) == '{"city": "Paris"}{}'
    calls = [(item.call_id, item.name, json.loads(item.arguments)) for item in final.output
             if item.type == "function_call"]
    assert calls == [("call_w", "get_weather", {"city": "Paris"}), ("call_t", "get_time", {})]


def test_prose_then_a_call_closes_the_message_first() -> None:
    chunks = [content_chunk("Checking."),
              *call_chunks(call(0, "call_w", "get_weather", '{"city": "Oslo"}'))]
    parsed = check_events(stream(shaper(tools=TOOLS), chunks))
    types = [event.type for event in parsed]
    assert types.index("response.output_item.done") < types.index(
        "response.function_call_arguments.delta")
    final = parsed[-1].response
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output_text == "Checking."
    assert final.output[1].arguments == '{"city": "Oslo"}'


def test_a_stream_cut_off_by_the_limit_ends_incomplete() -> None:
    """Status incomplete, in a ``response.completed`` event (see the module's docstring)."""
    parsed = check_events(stream(shaper(max_output_tokens=2), text_chunks("Hel", "lo",
                                                                            finish="length")))
    last = parsed[-1]
    assert last.type == "response.completed"
    assert last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output[0].status == "incomplete"
    assert last.response.output_text == "Hello"
    item_done = next(e for e in parsed if e.type == "response.output_item.done")
    assert item_done.item.status == "incomplete"


def test_an_empty_stream_still_has_its_message() -> None:
    parsed = check_events(stream(shaper(), [finish_chunk()]))
    assert [event.type for event in parsed] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert parsed[-1].response.output_text == ""


ERROR = {"error": {"message": "the worker went away", "type": "server_error", "param": None,
                   "code": "worker_lost"}}


def test_a_failed_stream_ends_with_response_failed_and_an_error() -> None:
    parsed = check_events(stream(shaper(), [content_chunk("Half an ans")], error=ERROR))
    failed, error = parsed[-2], parsed[-1]
    assert failed.type == "response.failed"
    assert failed.response.status == "failed"
    assert failed.response.error is not None
    assert failed.response.error.code == "server_error"
    assert failed.response.error.message == "the worker went away"
    assert failed.response.output[0].content[0].text == "Half an ans"
    assert error.type == "error"
    assert (error.message, error.code) == ("the worker went away", "worker_lost")


def test_a_bad_request_failure_keeps_its_kind() -> None:
    bad = {"error": {"message": "the text cannot start a JSON document",
                     "type": "invalid_request_error", "param": None, "code": "invalid_request"}}
    parsed = check_events(stream(shaper(), [], error=bad))
    assert parsed[-2].response.error.code == "invalid_prompt"
    limited = {"error": {"message": "slow down", "type": "rate_limit_error",
                         "code": "rate_limit_exceeded"}}
    assert check_events(stream(shaper(), [], error=limited))[-2].response.error.code == (
        "rate_limit_exceeded")


def test_the_sdk_raises_when_the_stream_fails() -> None:
    client = sdk_client(streamed_by([content_chunk("Half")], error=ERROR))
    seen: list[str] = []
    with pytest.raises(openai.APIError, match="the worker went away"):  # noqa: PT012
        for event in client.responses.create(model="smollm2", input="hi", stream=True):
            seen.append(event.type)
    assert seen[0] == "response.created"
    assert "response.failed" in seen


# --- requests -----------------------------------------------------------------------------------


def test_chat_request_carries_every_setting() -> None:
    req = ResponsesRequest.model_validate({
        "model": "smollm2", "instructions": "You are terse.", "input": "Weather?",
        "max_output_tokens": 64, "temperature": 0.5, "top_p": 0.8, "stream": True,
        "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False, "user": "u", "store": False, "truncation": "disabled"})
    chat = chat_request(req).model_dump(exclude_none=True, by_alias=True)
    assert chat["messages"] == [{"role": "system", "content": "You are terse."},
                                {"role": "user", "content": "Weather?"}]
    assert chat["max_completion_tokens"] == 64
    assert (chat["temperature"], chat["top_p"], chat["stream"]) == (0.5, 0.8, True)
    assert chat["parallel_tool_calls"] is False
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["tools"][0] == {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": TOOLS[0]["parameters"], "strict": True}}
    assert chat["tools"][1] == {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object"}}}
    assert "max_tokens" not in chat
    assert "n" not in chat
    assert "stream_options" not in chat
    assert chat["user"] == "u"


@pytest.mark.parametrize(("fmt", "expected"), [
    ({"type": "text"}, {"type": "text"}),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "json_schema", "name": "point", "strict": True, "description": "A point",
      "schema": {"type": "object", "properties": {"x": {"type": "number"}}}},
     {"type": "json_schema", "json_schema": {
         "name": "point", "strict": True, "description": "A point",
         "schema": {"type": "object", "properties": {"x": {"type": "number"}}}}}),
])
def test_text_format_becomes_response_format(fmt: dict[str, Any],
                                             expected: dict[str, Any]) -> None:
    req = ResponsesRequest.model_validate({"model": "m", "input": "x", "text": {"format": fmt}})
    chat = chat_request(req).model_dump(exclude_none=True, by_alias=True)
    assert chat["response_format"] == expected
    assert chat["stream"] is False


def test_tool_choice_modes_pass_through() -> None:
    for mode in ("none", "auto", "required"):
        req = ResponsesRequest.model_validate({"model": "m", "input": "x", "tools": TOOLS,
                                               "tool_choice": mode})
        assert chat_request(req).tool_choice == mode


def test_a_conversation_with_a_call_round_trips_into_chat_messages() -> None:
    """The SDK's own objects, passed back as the SDK sends them: the user's question, the
    earlier response's output (prose and a call), the call's output, a follow-up."""
    calls = [{"id": "call_w", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    earlier = Response.model_validate(
        shaper(tools=TOOLS).whole(answer("Let me check.", "tool_calls", calls)))
    passed_back = [item.model_dump(exclude_unset=True, mode="json") for item in earlier.output]
    body = {"model": "smollm2", "instructions": "Use the tools.", "tools": TOOLS,
            "input": [{"role": "user", "content": "Weather in Paris?"}, *passed_back,
                      {"type": "function_call_output", "call_id": "call_w",
                       "output": '{"temp_c": 21}'},
                      {"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "And in "},
                                   {"type": "input_text", "text": "Oslo?"}]}]}
    req = ResponsesRequest.model_validate(body)
    assert chat_messages(req) == [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant",
         "content": [{"type": "text", "text": "Let me check."}],
         "tool_calls": [{"id": "call_w", "type": "function",
                         "function": {"name": "get_weather",
                                      "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_w", "content": '{"temp_c": 21}'},
        {"role": "user", "content": [{"type": "text", "text": "And in "},
                                     {"type": "text", "text": "Oslo?"}]},
    ]
    chat = chat_request(req)  # the chat model's own checks pass (tool message, tool_calls)
    assert chat.messages[2].tool_calls is not None
    assert chat.messages[2].tool_calls[0].id == "call_w"
    assert chat.messages[3].role == "tool"
    assert chat.messages[3].tool_call_id == "call_w"


def test_calls_with_no_prose_start_their_own_assistant_turn() -> None:
    req = ResponsesRequest.model_validate({"model": "m", "tools": TOOLS, "input": [
        {"role": "user", "content": "Both?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_text", "text": "sunny"}]},
        {"type": "function_call_output", "call_id": "c2", "output": "noon"}]})
    messages = chat_messages(req)
    assert messages[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"}]
    chat_request(req)


def test_chunks_with_no_choice_zero_change_nothing() -> None:
    s = shaper()
    s.opening()
    assert s.chunk(chat_chunk([], USAGE)) == []
    assert s.chunk({"choices": None}) == []
    assert s.chunk(content_chunk("other", index=2)) == []


def test_a_late_fragment_of_an_earlier_call_still_reaches_the_response() -> None:
    """Calls arrive one after another; should a fragment of call 0 come after call 1 began,
    it is not lost from the final response (no delta event for a finished item, though)."""
    chunks = call_chunks(call(0, "c0", "get_time", "{"), call(1, "c1", "get_time", "{}"),
                         call(0, "", None, "}"))
    parsed = check_events(stream(shaper(tools=TOOLS), chunks))
    deltas = [(e.output_index, e.delta) for e in parsed
              if e.type == "response.function_call_arguments.delta"]
    assert deltas == [(0, "{"), (1, "{}")]
    final = parsed[-1].response
    assert [item.arguments for item in final.output] == ["{}", "{}"]


def test_response_ids_are_fresh() -> None:
    ids = {new_response_id() for _ in range(50)}
    assert len(ids) == 50
    assert all(i.startswith("resp_") for i in ids)


def test_the_sdks_stream_reader_returns_a_cut_off_answer() -> None:
    client = sdk_client(streamed_by(text_chunks("Once upon", " a", finish="length")))
    with client.responses.stream(model="smollm2", input="A story", max_output_tokens=3) as s:
        final = s.get_final_response()
    assert final.status == "incomplete"
    assert final.incomplete_details is not None
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == "Once upon a"
