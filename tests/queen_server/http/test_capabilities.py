"""A request that needs a capability goes only to workers that have it: an older worker that
would drop ``response_format`` is never chosen for it, the client gets a 400 naming the field when
no capable worker is connected, and a structured answer that fails over goes to a twin that
continues it under the same grammar. Real queen, real websockets, scripted workers."""

from __future__ import annotations

import asyncio

import openai
import pytest

from shared_schema import capabilities
from tests.support.sse import sse_events
from tests.support.workers import ECHO_MODEL, ScriptedWorker

ASK = [{"role": "user", "content": "one two three four five"}]
JSON = {"type": "json_object"}


async def test_no_capable_worker_is_a_400_naming_the_field_never_a_dropped_field(queen):
    old = await ScriptedWorker(queen.ws_url).start()
    client = queen.client()
    try:
        for extra, param in [({"response_format": JSON}, "response_format"),
                             ({"logprobs": True}, "logprobs"),
                             ({"logit_bias": {"5": 1}}, "logit_bias"),
                             ({"n": 2}, "n")]:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model=ECHO_MODEL, messages=ASK,
                                                     extra_body=extra)
            assert caught.value.body["param"] == param
            assert caught.value.body["code"] == "unsupported_by_workers"
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model=ECHO_MODEL, prompt="hi")
        assert caught.value.body["param"] == "prompt"
        with pytest.raises(openai.BadRequestError) as caught:
            await client.embeddings.create(model=ECHO_MODEL, input=[[1, 2, 3]])
        assert caught.value.body["param"] == "input"
        assert old.jobs == []  # nothing was sent to the worker that would have dropped it
        answer = await client.chat.completions.create(model=ECHO_MODEL, messages=ASK)
        assert answer.choices[0].message.content  # a plain request still goes to it
    finally:
        await old.stop()


async def test_only_a_capable_worker_is_chosen_among_older_ones(queen):
    olds = [await ScriptedWorker(queen.ws_url, max_jobs=4).start() for _ in range(3)]
    new = await ScriptedWorker(queen.ws_url, capabilities=[capabilities.GRAMMAR]).start()
    client = queen.client()
    try:
        for _ in range(3):
            await client.chat.completions.create(model=ECHO_MODEL, messages=ASK,
                                                 response_format=JSON)
        assert len(new.jobs) == 3
        assert all(not old.jobs for old in olds)
        assert new.jobs[0].openai_req["response_format"] == JSON
    finally:
        for worker in [*olds, new]:
            await worker.stop()


async def test_a_tools_request_reaches_the_worker_as_a_grammar_and_plain_turns(queen):
    new = await ScriptedWorker(queen.ws_url, capabilities=[capabilities.GRAMMAR]).start()
    tool = {"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}}, "required": ["city"]}}}
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Snow."}]
    try:
        await queen.client().chat.completions.create(model=ECHO_MODEL, messages=turn,
                                                     tools=[tool], tool_choice="required")
        [job] = new.jobs
        request = job.openai_req
        assert "tools" not in request
        assert "tool_choice" not in request
        assert request["response_format"]["type"] == "json_schema"
        for message in request["messages"]:
            assert set(message) <= {"role", "content", "name"}
            assert isinstance(message["content"], str)
        assert "get_weather" in request["messages"][0]["content"]  # the tools' instructions
        assert any("Snow." in message["content"] for message in request["messages"])
    finally:
        await new.stop()


async def test_a_structured_stream_fails_over_to_a_twin_with_the_same_grammar(queen):
    grammar = [capabilities.GRAMMAR]
    first = await ScriptedWorker(queen.ws_url, behaviour="die_mid", continues=True,
                                 capabilities=grammar).start()
    # A twin without a grammar holds the same file but must not be chosen.
    plain_twin = await ScriptedWorker(queen.ws_url, continues=True).start()
    body = {"model": ECHO_MODEL, "messages": ASK, "stream": True, "response_format": JSON}
    task = asyncio.create_task(sse_events(queen.base_url, body))
    try:
        async with asyncio.timeout(5):
            await first.job_arrived.wait()
        twin = await ScriptedWorker(queen.ws_url, continues=True, capabilities=grammar).start()
        await queen.wait_until(lambda: len(queen.state.registry) == 3, what="twin connected")
        first.release.set()
        async with asyncio.timeout(15):
            events = await task
        assert events[-1] == "[DONE]"
        [job] = twin.jobs
        assert job.continuation  # it went on from the text delivered...
        assert job.openai_req["response_format"] == JSON  # ...under the same grammar
        assert plain_twin.jobs == []
        await twin.stop()
    finally:
        await first.stop()
        await plain_twin.stop()
