"""The tools plan (schema, instructions), the history rendering and whole answers."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from llama_cpp.llama_grammar import LlamaGrammar, json_schema_to_gbnf

from queen_server.shaping import tools
from shared_schema.json_schemas import check_json_schema, validation_problem
from shared_schema.openai_requests import ChatCompletionRequest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
                   "required": ["city", "unit"], "additionalProperties": False,
                   "$defs": {"Unit": {"type": "string", "enum": ["c", "f"]}}}}}
# A name that is a prefix of another, with its own "$defs" entry of the same name.
GET = {"type": "function", "function": {
    "name": "get", "parameters": {
        "type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}},
        "required": ["unit"], "$defs": {"Unit": {"type": "integer"}}}}}
NO_PARAMS = {"type": "function", "function": {"name": "now"}}
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


def check(schema: dict[str, Any], value: Any) -> None:
    problem = validation_problem(schema, value)
    assert problem is None, problem


def refused(schema: dict[str, Any], value: Any) -> bool:
    return validation_problem(schema, value) is not None


# --- plan ---


def test_no_tools_or_choice_none_goes_out_plain():
    assert tools.plan(None, None, None) is None
    assert tools.plan([], "auto", None) is None
    assert tools.plan([WEATHER], "none", True) is None


def test_auto_allows_prose_or_calls_of_any_tool():
    plan = tools.plan([WEATHER, GET], None, None)
    assert plan is not None
    assert (plan.mode, plan.parallel, plan.names) == ("auto", True, ("get_weather", "get"))
    check(plan.schema, {"content": "It is sunny."})
    two = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}},
                          {"name": "get", "arguments": {"unit": 3}}]}
    check(plan.schema, two)
    assert refused(plan.schema, {"tool_calls": []})
    assert refused(plan.schema, {"content": "x", "extra": 1})
    assert refused(plan.schema, {"tool_calls": [{"name": "nope", "arguments": {}}]})
    # Each function's own "$defs" stays its own: get's Unit is an integer, get_weather's isn't.
    assert refused(plan.schema, {"tool_calls": [{"name": "get", "arguments": {"unit": "c"}}]})
    assert refused(plan.schema, {"tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Oslo", "unit": 3}}]})
    assert '{"content": "<your answer>"}' in plan.instructions


def test_required_allows_no_prose():
    plan = tools.plan([WEATHER, GET], "required", None)
    assert plan is not None
    assert plan.mode == "required"
    assert refused(plan.schema, {"content": "It is sunny."})
    check(plan.schema, {"tool_calls": [{"name": "get", "arguments": {"unit": 1}}]})
    assert "must call at least one tool" in plan.instructions
    assert '"content"' not in plan.instructions


def test_a_named_function_allows_only_that_function():
    choice = {"type": "function", "function": {"name": "get"}}
    plan = tools.plan([WEATHER, GET], choice, None)
    assert plan is not None
    assert (plan.mode, plan.names) == ("function", ("get",))
    check(plan.schema, {"tool_calls": [{"name": "get", "arguments": {"unit": 1}}]})
    assert refused(plan.schema, {"tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]})
    assert refused(plan.schema, {"content": "hi"})
    assert 'You must call the tool "get"' in plan.instructions
    assert "get_weather" not in plan.instructions


def test_a_named_function_that_is_not_a_tool_is_an_error():
    with pytest.raises(ValueError, match="nope"):
        tools.plan([WEATHER], {"type": "function", "function": {"name": "nope"}}, None)


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_parallel_false_allows_one_call(choice):
    plan = tools.plan([WEATHER, GET], choice, False)
    assert plan is not None
    assert not plan.parallel
    one = {"name": "get", "arguments": {"unit": 1}}
    check(plan.schema, {"tool_calls": [one]})
    assert refused(plan.schema, {"tool_calls": [one, one]})
    assert "exactly one call" in plan.instructions
    parallel = tools.plan([WEATHER, GET], choice, True)
    assert parallel is not None
    check(parallel.schema, {"tool_calls": [one, one, one]})


def test_a_tool_without_parameters_takes_an_empty_object():
    plan = tools.plan([NO_PARAMS], "required", None)
    assert plan is not None
    check(plan.schema, {"tool_calls": [{"name": "now", "arguments": {}}]})
    assert refused(plan.schema, {"tool_calls": [{"name": "now", "arguments": {"x": 1}}]})
    assert refused(plan.schema, {"tool_calls": [{"name": "now"}]})


def test_refs_to_the_parameters_root_and_definitions_are_moved_with_them():
    tree = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object",
        "properties": {"label": {"type": "string"},
                       "kids": {"type": "array", "items": {"$ref": "#/definitions/Node"}},
                       "same": {"$ref": "#/properties/label"}},
        "required": ["label"],
        "definitions": {"Node": {"type": "object", "properties": {
            "v": {"type": "integer"}}, "required": ["v"]}}}}}
    plan = tools.plan([tree], "required", None)
    assert plan is not None
    check(plan.schema, {"tool_calls": [{"name": "tree", "arguments": {
        "label": "a", "kids": [{"v": 1}], "same": "b"}}]})
    assert refused(plan.schema, {"tool_calls": [{"name": "tree", "arguments": {
        "label": "a", "kids": [{"v": "one"}]}}]})
    assert refused(plan.schema, {"tool_calls": [{"name": "tree", "arguments": {
        "label": "a", "same": 2}}]})
    assert "#/definitions/Node" not in json.dumps(plan.schema)


def test_a_ref_inside_data_is_left_alone():
    odd = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"x": {"const": {"$ref": "#/here"}}}}}}
    plan = tools.plan([odd], "required", None)
    assert plan is not None
    check(plan.schema, {"tool_calls": [{"name": "odd", "arguments": {"x": {"$ref": "#/here"}}}]})


def test_the_callers_tools_are_not_changed():
    before = json.dumps([WEATHER, GET])
    tools.plan([WEATHER, GET], "auto", None)
    assert json.dumps([WEATHER, GET]) == before


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function",
                                                         "function": {"name": "get"}}])
@pytest.mark.parametrize("parallel", [None, False])
def test_the_schema_is_one_a_worker_accepts_and_turns_into_a_grammar(choice, parallel):
    plan = tools.plan([WEATHER, GET, NO_PARAMS], choice, parallel)
    assert plan is not None
    assert check_json_schema(plan.schema) is plan.schema
    Draft202012Validator.check_schema(plan.schema)
    grammar = json_schema_to_gbnf(json.dumps(plan.schema))
    # Keys come in the schema's order, which the stream parser relies on.
    assert re.search(r'name-kv "," space [\w-]*arguments-kv', grammar)
    LlamaGrammar.from_json_schema(json.dumps(plan.schema), verbose=False)
    # The response_format a worker request carries passes the request model's own checks.
    request = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "response_format": plan.response_format})
    assert request.response_format is not None


@pytest.mark.parametrize("exclude_none", [True, False])
def test_the_plan_and_history_from_a_parsed_request(exclude_none):
    request = ChatCompletionRequest.model_validate({
        "model": "m", "messages": HISTORY, "tools": [WEATHER, GET, NO_PARAMS],
        "tool_choice": {"type": "function", "function": {"name": "now"}},
        "parallel_tool_calls": False})
    body = request.model_dump(by_alias=True, exclude_none=exclude_none)
    plan = tools.plan(body["tools"], body["tool_choice"], body["parallel_tool_calls"])
    assert plan is not None
    assert plan.names == ("now",)
    assert not plan.parallel
    check(plan.schema, {"tool_calls": [{"name": "now", "arguments": {}}]})
    assert tools.worker_messages(body["messages"], plan) == tools.worker_messages(HISTORY, plan)


# --- worker_messages ---

HISTORY: list[dict[str, Any]] = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo"},
                                 {"type": "text", "text": "and Bergen?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Bergen","unit":"c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "5 C, rain"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "7 C"}]},
    {"role": "assistant", "content": "Oslo 5 C, Bergen 7 C."},
    {"role": "user", "content": "Thanks"},
]


def test_history_turns_are_plain_text_with_the_instructions_first():
    plan = tools.plan([WEATHER], "auto", None)
    assert plan is not None
    out = tools.worker_messages(HISTORY, plan)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant",
                                        "user"]
    assert all(isinstance(m["content"], str) and set(m) == {"role", "content"} for m in out)
    assert out[0]["content"] == plan.instructions + "\n\nBe brief."
    assert out[1]["content"] == "Weather in Oslo\nand Bergen?"
    # The earlier calls are the JSON the model writes, and that JSON fits the answer schema.
    written = json.loads(out[2]["content"])
    assert written == {"tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}},
        {"name": "get_weather", "arguments": {"city": "Bergen", "unit": "c"}}]}
    check(plan.schema, written)
    # Both results in one user turn, each naming its function and call.
    assert out[3]["content"] == ("Tool result (get_weather, call id call_1):\n5 C, rain\n\n"
                                 "Tool result (get_weather, call id call_2):\n7 C")
    assert out[4] == {"role": "assistant", "content": "Oslo 5 C, Bergen 7 C."}


def test_history_without_a_plan_has_no_instructions():
    out = tools.worker_messages(HISTORY, None)
    assert out[0] == {"role": "system", "content": "Be brief."}
    assert json.loads(out[2]["content"])["tool_calls"][0]["name"] == "get_weather"


def test_instructions_become_the_system_message_when_there_is_none():
    plan = tools.plan([WEATHER], "required", None)
    assert plan is not None
    out = tools.worker_messages([{"role": "user", "content": "hi"}], plan)
    assert out == [{"role": "system", "content": plan.instructions},
                   {"role": "user", "content": "hi"}]


def test_history_edge_cases():
    out = tools.worker_messages([
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "unknown", "content": "x"},
        {"role": "assistant", "content": None},
    ], None)
    assert out[1]["content"] == ('Checking.\n\n{"tool_calls": [{"name": "f", '
                                 '"arguments": "not json"}]}')
    assert out[2] == {"role": "user", "content": "Tool result (call id unknown):\nx"}
    assert out[3] == {"role": "assistant", "content": ""}


# --- answer_message ---


def test_a_whole_answer_with_calls():
    plan = tools.plan([WEATHER, GET], "auto", None)
    assert plan is not None
    text = ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo", '
            '"unit": "c"}}, {"name": "get", "arguments": {"unit": 2}}]}')
    message, reason = tools.answer_message(text, plan, "stop")
    assert reason == "tool_calls"
    assert message["role"] == "assistant"
    assert message["content"] is None
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get"]
    assert all(CALL_ID.match(c["id"]) and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
    check(GET["function"]["parameters"], json.loads(calls[1]["function"]["arguments"]))


def test_a_whole_prose_answer():
    plan = tools.plan([WEATHER], "auto", None)
    assert plan is not None
    message, reason = tools.answer_message('{"content": "Sunny \\u2600 \\"hot\\""}', plan, "stop")
    assert (message, reason) == ({"role": "assistant", "content": 'Sunny \u2600 "hot"'}, "stop")


def test_a_cut_off_answer_keeps_its_prose_and_its_whole_calls_only():
    plan = tools.plan([WEATHER, GET], "auto", None)
    assert plan is not None
    message, reason = tools.answer_message('{"content": "It is sun', plan, "length")
    assert (message, reason) == ({"role": "assistant", "content": "It is sun"}, "length")
    text = ('{"tool_calls": [{"name": "get", "arguments": {"unit": 2}}, {"name": "get_weather", '
            '"arguments": {"city": "Os')
    message, reason = tools.answer_message(text, plan, "length")
    assert reason == "length"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get"]
    message, reason = tools.answer_message('{"tool_calls": [{"name": "ge', plan, "length")
    assert (message, reason) == ({"role": "assistant", "content": ""}, "length")


def test_an_answer_that_is_not_json_is_prose():
    plan = tools.plan([WEATHER], "auto", None)
    assert plan is not None
    message, reason = tools.answer_message("  I cannot {do} that", plan, "stop")
    assert (message, reason) == ({"role": "assistant", "content": "I cannot {do} that"}, "stop")


def test_broken_json_keeps_what_came_before_and_no_broken_call():
    plan = tools.plan([WEATHER], "auto", None)
    assert plan is not None
    message, reason = tools.answer_message('{"content": "ok" ]]] trailing', plan, "stop")
    assert (message, reason) == ({"role": "assistant", "content": "ok"}, "stop")
    bad_args = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": tru}}]}'
    message, reason = tools.answer_message(bad_args, plan, "stop")
    assert (message, reason) == ({"role": "assistant", "content": ""}, "stop")


def test_unknown_keys_are_skipped_and_arguments_may_come_first():
    plan = tools.plan([WEATHER], "auto", None)
    assert plan is not None
    text = ('{"note": {"content": "no", "tool_calls": [1]}, "tool_calls": [{"arguments": '
            '{"city": "Rome", "unit": "f"}, "extra": [true, null, -1.5e3], '
            '"name": "get_weather"}]}')
    message, reason = tools.answer_message(text, plan, "stop")
    assert reason == "tool_calls"
    assert message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Rome", "unit": "f"}


def test_a_schema_with_an_integer_past_64_bits_is_a_clear_error_not_a_crash():
    # Found by the HTTP fuzzer: orjson cannot size it, which once answered a 500.
    with pytest.raises(ValueError, match="JSON cannot carry"):
        check_json_schema({"type": "object", "properties": {"a": {"maximum": -(2**70)}}})
