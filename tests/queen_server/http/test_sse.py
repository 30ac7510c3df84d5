"""The SSE body of a streamed chat completion, byte for byte, and its cleanup when Starlette
cancels it (with anyio) because the client went away."""

from __future__ import annotations

import asyncio

import anyio
import orjson
import pytest

from queen_server.errors import GatewayTimeout, WorkerFailed
from queen_server.http.sse import DONE, answer_events, error_event, sse, stream_answer
from queen_server.shaping.chat import ChatShaper
from queen_server.shaping.view import ChatView
from queen_server.swarm.jobs import WorkerLost
from queen_server.swarm.metering import UNBOUNDED
from shared_schema import JobError
from shared_schema.answers import AnswerStamp
from tests.support.job_runs import Charges, FakeDispatcher, FakeRun, chunk, result

HEAD = b'"id":"chatcmpl-q","object":"chat.completion.chunk","created":1700000000,' \
       b'"model":"org/repo:Q4_K_M"'


def context(include_usage: bool = False) -> ChatView:
    stamp = AnswerStamp("chatcmpl-q", "org/repo:Q4_K_M", 1_700_000_000)
    return ChatView(stamp, ChatShaper(include_usage, stamp))


async def body_of(run: FakeRun, ctx: ChatView, dispatcher: FakeDispatcher,
                  charges: Charges) -> list[bytes]:
    async with asyncio.timeout(5):
        body = stream_answer(run, ctx, dispatcher, charges, UNBOUNDED)  # type: ignore[arg-type]
        return [part async for part in body]


def test_an_event_is_one_data_line_and_a_blank_line():
    assert sse({"a": 1, "b": [None]}) == b'data: {"a":1,"b":[null]}\n\n'
    assert DONE == b"data: [DONE]\n\n"


def test_an_error_event_carries_the_body_a_plain_answer_would_have():
    event = error_event(context(), WorkerFailed("the worker failed: boom", code="engine_error"))
    assert event == (b'data: {"error":{"message":"the worker failed: boom","type":"server_error",'
                     b'"param":null,"code":"engine_error"}}\n\n')


def test_a_whole_answer_becomes_the_events_of_its_chunks():
    answer = {"choices": [{"message": {"role": "assistant", "content": "Hi"},
                           "finish_reason": "length"}]}
    assert answer_events(context(), answer) == [
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"},'
        b'"finish_reason":null}],' + HEAD + b'}\n\n',
        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}],' + HEAD + b'}\n\n',
    ]


async def test_a_stream_is_the_stamped_chunks_then_usage_then_done_in_batches():
    run = FakeRun(chunk("Hel", role="assistant"), ready=[chunk("lo")])
    run.feed(chunk(finish_reason="stop"), result(5, 2))
    charges, dispatcher = Charges(), FakeDispatcher()
    body = await body_of(run, context(include_usage=True), dispatcher, charges)
    assert body == [
        # the first frame and the one already waiting go out in one write
        b"data: {" + HEAD + b',"choices":[{"index":0,"delta":{"role":"assistant","content":'
        b'"Hel"},"finish_reason":null}]}\n\n'
        b"data: {" + HEAD + b',"choices":[{"index":0,"delta":{"content":"lo"},'
        b'"finish_reason":null}]}\n\n',
        b"data: {" + HEAD + b',"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,'
        b'"total_tokens":7},' + HEAD + b"}\n\n" + DONE,
    ]
    parts = charges.calls[0]  # charged the true usage...
    assert [(p.worker_key, p.prompt_tokens, p.completion_tokens) for p in parts] == [
        ("worker-a", 5, 2)]
    assert len(charges.calls) == 2  # ...and the cleanup's call is a no-op on a charged hold
    assert run.finished == ["client went away"]
    assert dispatcher.results == [True]


async def test_a_worker_that_did_not_stream_is_streamed_as_chunks_without_usage():
    run = FakeRun(result(5, 1, data={"choices": [
        {"message": {"role": "assistant", "content": "Hi"}, "finish_reason": "length"}]}))
    body = await body_of(run, context(), FakeDispatcher(), Charges())
    assert body == [b"".join(answer_events(context(), {"choices": [
        {"message": {"role": "assistant", "content": "Hi"}, "finish_reason": "length"}]}))
        + DONE]


async def test_a_failure_that_cannot_fail_over_ends_the_stream_with_its_error():
    run = FakeRun(chunk("Hel", role="assistant"))
    run.feed(JobError(id="job", code="invalid_request", message="bad", retryable=False))
    dispatcher, charges = FakeDispatcher(), Charges()
    body = await body_of(run, context(), dispatcher, charges)
    assert orjson.loads(body[-1][6:])["error"]["code"] == "invalid_request"
    assert dispatcher.failures == ["invalid_request"]
    assert [(p.completion_tokens, p.completed) for p in charges.calls[-1]] == [(1, False)]
    assert run.finished == ["client went away"]


async def test_a_lost_worker_goes_on_on_a_twin_without_repeating_the_role():
    first = FakeRun(chunk("Hel", role="assistant"))
    first.feed(WorkerLost("socket closed"))
    twin = FakeRun(chunk("lo", role="assistant"), worker="worker-b")
    twin.feed(chunk(finish_reason="stop"), result(8, 1))
    dispatcher = FakeDispatcher(twin)
    body = b"".join(await body_of(first, context(), dispatcher, Charges()))
    events = [orjson.loads(line[6:]) for line in body.split(b"\n\n")[:-2]]
    assert [choice["delta"] for event in events for choice in event["choices"]] == [
        {"role": "assistant", "content": "Hel"}, {"content": "lo"}, {}]
    assert body.endswith(DONE)
    assert dispatcher.continued == [("Hel", 1)]
    assert first.finished == ["continuing on another worker"]
    assert twin.finished == ["client went away"]


async def test_no_twin_or_the_total_timeout_ends_the_stream_with_an_error_event():
    run = FakeRun(chunk("Hel", role="assistant"))
    run.feed(WorkerLost("socket closed"))
    body = await body_of(run, context(), FakeDispatcher(), Charges())
    assert orjson.loads(body[-1][6:])["error"]["code"] == "no_capacity"
    late = FakeRun(chunk("Hel", role="assistant"))
    late.feed(GatewayTimeout("the worker did not finish the answer in time"))
    body = await body_of(late, context(), FakeDispatcher(), Charges())
    assert body[-1] == error_event(
        context(), GatewayTimeout("the worker did not finish the answer in time"))
    assert late.finished == ["client went away"]


async def test_a_client_gone_mid_stream_is_charged_what_it_got_and_the_lease_ends():
    """Starlette cancels the body with anyio, which cancels again on every loop turn: the
    charge and the lease's end must still run to their end."""
    run = FakeRun(chunk("Hel", role="assistant"))
    run.finish_gate = asyncio.Event()
    charges = Charges()
    received: list[bytes] = []

    async def open_gate_once_ending() -> None:
        await run.finish_started.wait()
        for _ in range(5):  # let anyio try to cancel the cleanup a few times
            await asyncio.sleep(0)
        assert run.finish_gate is not None
        run.finish_gate.set()

    opener = asyncio.create_task(open_gate_once_ending())
    async with asyncio.timeout(5):
        async with anyio.create_task_group() as group:

            async def client() -> None:
                async for part in stream_answer(run, context(), FakeDispatcher(), charges,
                                               UNBOUNDED):  # type: ignore[arg-type]
                    received.append(part)

            group.start_soon(client)
            await run.waiting.wait()  # the first chunk is out; the worker is generating
            group.cancel_scope.cancel()
        await opener
    assert len(received) == 1
    assert run.finished == ["client went away"]
    [parts] = charges.calls
    assert [(p.worker_key, p.completion_tokens, p.completed) for p in parts] == [
        ("worker-a", 1, False)]


@pytest.mark.parametrize("include_usage", [False, True])
async def test_only_a_client_that_asked_gets_the_usage_chunk(include_usage: bool):
    run = FakeRun(chunk("Hi", role="assistant"))
    run.feed(result(5, 1))
    body = b"".join(await body_of(run, context(include_usage), FakeDispatcher(), Charges()))
    assert (b'"usage":' in body) is include_usage
    assert body.endswith(DONE)
