"""The relay's books and cleanup: ``collect``, ``assemble_chat``, and ``run_to_end``, which ends
a lease even when the request is cancelled while it does (the stdlib stand-in for anyio's shield).
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from queen_server.errors import InvalidRequest, WorkerFailed
from queen_server.swarm.jobs import WorkerLost
from queen_server.swarm.metering import UNBOUNDED
from queen_server.swarm.relay import assemble_chat, collect, run_to_end
from shared_schema import JobError
from shared_schema.answers import AnswerStamp
from tests.support.job_runs import FakeDispatcher, FakeRun, chunk, result

CTX = AnswerStamp("chatcmpl-q", "org/repo:Q4_K_M", 1_700_000_000)


# --- run_to_end ---------------------------------------------------------------------------------


class Cleanup:
    """A cleanup that waits for ``release`` once started, and logs when it ends."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, value: int = 7) -> int:
        self.started.set()
        await self.release.wait()
        self.log.append("cleanup done")
        return value


async def test_the_cleanups_result_comes_back_when_nothing_cancels():
    log: list[str] = []
    cleanup = Cleanup(log)
    cleanup.release.set()
    assert await run_to_end(cleanup(42)) == 42
    assert log == ["cleanup done"]


async def test_a_cancellation_waits_for_the_cleanup_to_finish_however_often_it_comes():
    log: list[str] = []
    cleanup = Cleanup(log)

    async def request() -> None:
        try:
            await run_to_end(cleanup())
        except asyncio.CancelledError:
            log.append("cancellation raised")
            raise
        log.append("went on")  # never: the cancellation must still reach the caller

    task = asyncio.create_task(request())
    async with asyncio.timeout(5):
        await cleanup.started.wait()
    for _ in range(3):  # anyio delivers a cancellation again on every loop turn
        task.cancel()
        await asyncio.sleep(0)
    assert not task.done()
    assert log == []
    cleanup.release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log == ["cleanup done", "cancellation raised"]


async def test_a_timeout_that_fires_during_the_cleanup_is_still_a_timeout():
    log: list[str] = []
    loop = asyncio.get_running_loop()

    async def bounded() -> None:
        async with asyncio.timeout(None) as deadline:

            async def cleanup() -> None:
                deadline.reschedule(loop.time() - 1)  # fires on the next loop turn...
                release = asyncio.Event()
                loop.call_soon(release.set)  # ...before this releases the cleanup
                await release.wait()
                log.append("cleanup done")

            await run_to_end(cleanup())
            log.append("went on")

    with pytest.raises(TimeoutError):
        await bounded()
    assert log == ["cleanup done"]
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_cancellation_in_the_turn_the_cleanup_ends_is_not_lost():
    outer = asyncio.current_task()
    assert outer is not None

    async def cleanup() -> None:
        # Runs after run_to_end's own wake-up: the cancellation lands after the cleanup's end
        # has been noted, before this task resumes.
        asyncio.current_task().add_done_callback(lambda _t: outer.cancel())  # type: ignore[union-attr]

    with pytest.raises(asyncio.CancelledError):
        await run_to_end(cleanup())
    outer.uncancel()


async def test_a_failing_cleanup_raises_its_error():
    async def cleanup() -> None:
        raise RuntimeError("socket gone")

    with pytest.raises(RuntimeError, match="socket gone"):
        await run_to_end(cleanup())


async def test_a_cleanup_that_fails_under_cancellation_is_the_cancellations_cause():
    started, release = asyncio.Event(), asyncio.Event()

    async def cleanup() -> None:
        started.set()
        await release.wait()
        raise RuntimeError("socket gone")

    task = asyncio.create_task(run_to_end(cleanup()))
    async with asyncio.timeout(5):
        await started.wait()
    task.cancel()
    await asyncio.sleep(0)
    release.set()
    with pytest.raises(asyncio.CancelledError) as caught:
        await task
    assert isinstance(caught.value.__cause__, RuntimeError)


# --- collect ------------------------------------------------------------------------------------


async def test_collect_gathers_the_chunks_and_ends_the_lease_once():
    run = FakeRun(chunk("Hel", role="assistant"))
    run.feed(chunk("lo"), chunk(finish_reason="length"), result(5, 2))
    dispatcher = FakeDispatcher()
    collected = await collect(run, dispatcher, UNBOUNDED)  # type: ignore[arg-type]
    assert collected.answer.text == "Hello"
    assert collected.usage.completion_tokens == 2
    assert [(p.worker_key, p.prompt_tokens, p.completion_tokens) for p in collected.parts] == [
        ("worker-a", 5, 2)]
    assert run.finished == ["client went away"]  # a no-op on the real lease: the job ended
    assert dispatcher.results == [False]


async def test_collect_ends_the_lease_even_when_cancelled_while_ending_it():
    run = FakeRun(chunk("Hel", role="assistant"))
    run.finish_gate = asyncio.Event()
    task = asyncio.create_task(collect(run, FakeDispatcher(), UNBOUNDED))  # type: ignore[arg-type]
    async with asyncio.timeout(5):
        await run.waiting.wait()
    task.cancel()  # the client went away
    async with asyncio.timeout(5):
        await run.finish_started.wait()
    task.cancel()  # and the request is cancelled again while the lease ends
    await asyncio.sleep(0)
    assert not task.done()
    run.finish_gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert run.finished == ["client went away"]


async def test_collect_raises_a_failure_that_cannot_fail_over_and_ends_the_lease():
    run = FakeRun(JobError(id="job", code="engine_error", message="bad", retryable=False))
    with pytest.raises(WorkerFailed, match="bad"):
        await collect(run, FakeDispatcher(), UNBOUNDED)  # type: ignore[arg-type]
    assert run.failures == ["engine_error"]
    assert run.finished == ["client went away"]


async def test_a_request_the_worker_refuses_as_invalid_is_the_clients_400():
    run = FakeRun(JobError(id="job", code="invalid_request", message="schema too deep",
                           retryable=False))
    with pytest.raises(InvalidRequest, match="schema too deep") as caught:
        await collect(run, FakeDispatcher(), UNBOUNDED)  # type: ignore[arg-type]
    assert caught.value.status_code == 400
    assert run.failures == ["invalid_request"]


async def test_a_plain_answer_goes_on_on_a_twin_and_reads_as_one():
    first = FakeRun(chunk("Hello", role="assistant"))
    first.feed(WorkerLost("socket closed"))
    twin = FakeRun(result(9, 3, data={"choices": [
        {"index": 0, "message": {"role": "assistant", "content": " world"},
         "finish_reason": "length"}]}), worker="worker-b")
    dispatcher = FakeDispatcher(twin)
    collected = await collect(first, dispatcher, UNBOUNDED)  # type: ignore[arg-type]
    assert dispatcher.continued == [("Hello", 1)]
    assert first.finished == ["continuing on another worker"]
    assert twin.finished == ["client went away"]
    answer = assemble_chat(CTX, collected)
    assert orjson.dumps(answer) == (
        b'{"id":"chatcmpl-q","object":"chat.completion","created":1700000000,'
        b'"model":"org/repo:Q4_K_M","choices":[{"index":0,"message":{"role":"assistant",'
        b'"content":"Hello world"},"finish_reason":"length"}],"usage":{"prompt_tokens":8,'
        b'"completion_tokens":4,"total_tokens":12}}')


def _scored(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}


async def test_a_plain_answer_with_logprobs_keeps_them_across_a_failover():
    """The checkpoint's log probabilities, then the twin's: one entry per token of the text."""
    checkpoint = chunk("Hello", role="assistant")
    checkpoint.data["choices"][0]["logprobs"] = {"content": [_scored("Hel", -0.1),
                                                             _scored("lo", -0.2)]}
    first = FakeRun(checkpoint)
    first.feed(WorkerLost("socket closed"))
    twin = FakeRun(result(9, 1, data={"choices": [
        {"index": 0, "message": {"role": "assistant", "content": " world"},
         "logprobs": {"content": [_scored(" world", -0.3)]}, "finish_reason": "stop"}]}),
        worker="worker-b")
    collected = await collect(first, FakeDispatcher(twin), UNBOUNDED)  # type: ignore[arg-type]
    [choice] = assemble_chat(CTX, collected)["choices"]
    assert choice["message"]["content"] == "Hello world"
    tokens = [entry["token"] for entry in choice["logprobs"]["content"]]
    assert "".join(tokens) == "Hello world"
    assert [entry["logprob"] for entry in choice["logprobs"]["content"]] == [-0.1, -0.2, -0.3]


# --- assemble_chat ------------------------------------------------------------------------------


async def test_a_workers_whole_answer_is_relayed_with_the_queens_stamp():
    whole = {"object": "chat.completion", "id": "w", "model": "w", "choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hi"}}]}
    collected = await collect(FakeRun(result(5, 1, data=whole)), FakeDispatcher(),  # type: ignore[arg-type]
                              UNBOUNDED)
    answer = assemble_chat(CTX, collected)
    assert orjson.dumps(answer) == (
        b'{"object":"chat.completion","id":"chatcmpl-q","model":"org/repo:Q4_K_M","choices":'
        b'[{"index":0,"finish_reason":"stop","message":{"role":"assistant","content":"Hi"}}],'
        b'"created":1700000000,"usage":{"prompt_tokens":5,"completion_tokens":1,'
        b'"total_tokens":6}}')
    assert whole["id"] == "w"  # the worker's frame is left as it came


async def test_an_answer_sent_only_in_chunks_is_assembled_and_stops_by_default():
    run = FakeRun(chunk("Hi", role="assistant"))
    run.feed(result(5, 1))
    answer = assemble_chat(CTX, await collect(run, FakeDispatcher(), UNBOUNDED))  # type: ignore[arg-type]
    assert answer["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}]
    assert answer["object"] == "chat.completion"
    assert answer["id"] == "chatcmpl-q"
