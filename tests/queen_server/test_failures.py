"""Workers that die, fail, hang or are busy; clients that go away. Real sockets throughout."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from shared_schema import Result, Usage, encode
from tests.support.queen import running_queen
from tests.support.workers import ECHO_MODEL, ScriptedWorker

USER = [{"role": "user", "content": "hi there"}]


async def _session(queen, worker):
    return queen.state.registry.get(worker.pubkey)


async def test_worker_dying_before_first_token_is_retried_elsewhere(queen):
    # The dying worker has the model loaded, so routing tries it first.
    dying = await ScriptedWorker(queen.ws_url, behaviour="die", loaded=True).start()
    healthy = await ScriptedWorker(queen.ws_url, loaded=False).start()
    try:
        for stream in (False, True):
            if stream:
                dying = await ScriptedWorker(queen.ws_url, behaviour="die", loaded=True).start()
            response = await queen.client().chat.completions.create(
                model=ECHO_MODEL, messages=USER, stream=stream)
            if stream:
                text = "".join([c.choices[0].delta.content or "" async for c in response
                                if c.choices])
            else:
                text = response.choices[0].message.content
            assert text == "echo: hi there"
            assert len(dying.jobs) == 1
            await asyncio.wait_for(dying.closed.wait(), 5)
        assert len(healthy.jobs) == 2
        await queen.wait_until(lambda: len(queen.state.registry) == 1)
    finally:
        await healthy.stop()


async def test_retryable_error_moves_on_and_fatal_error_does_not(queen):
    flaky = await ScriptedWorker(queen.ws_url, behaviour="error", loaded=True).start()
    healthy = await ScriptedWorker(queen.ws_url, loaded=False).start()
    try:
        answer = await queen.client().chat.completions.create(model=ECHO_MODEL, messages=USER)
        assert answer.choices[0].message.content == "echo: hi there"
        assert (len(flaky.jobs), len(healthy.jobs)) == (1, 1)
        flaky.behaviour = healthy.behaviour = "fatal"
        with pytest.raises(openai.APIStatusError) as caught:
            await queen.client().chat.completions.create(model=ECHO_MODEL, messages=USER)
        assert caught.value.status_code == 502
        assert caught.value.code == "engine_failed"
        assert len(flaky.jobs) + len(healthy.jobs) == 3  # one more job, no retry
    finally:
        await flaky.stop()
        await healthy.stop()


async def test_every_worker_failing_is_502_after_bounded_attempts(tmp_path):
    async with running_queen(tmp_path, max_attempts=2) as queen:
        workers = [await ScriptedWorker(queen.ws_url, behaviour="error").start()
                   for _ in range(3)]
        try:
            with pytest.raises(openai.APIStatusError) as caught:
                await queen.client().chat.completions.create(model=ECHO_MODEL, messages=USER)
            assert caught.value.status_code == 502
            assert caught.value.code == "worker_error"
            assert sum(len(worker.jobs) for worker in workers) == 2
            assert all(len(session.jobs) == 0 for session in queen.state.registry)
        finally:
            for worker in workers:
                await worker.stop()


async def test_client_leaving_a_stream_cancels_the_job_and_frees_the_slot(queen):
    worker = await ScriptedWorker(queen.ws_url, behaviour="gated").start()
    try:
        body = {"model": ECHO_MODEL, "messages": USER, "stream": True}
        async with httpx.AsyncClient(base_url=queen.base_url) as http, \
                http.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    break  # got the first token; now hang up
        await asyncio.wait_for(worker.cancelled.wait(), 5)
        assert worker.cancels[0].id == worker.jobs[0].id
        session = await _session(queen, worker)
        await queen.wait_until(lambda: session.free_slots == 1, what="slot freed")
    finally:
        await worker.stop()


async def test_client_leaving_a_plain_request_cancels_the_job(queen):
    worker = await ScriptedWorker(queen.ws_url, behaviour="hang").start()
    try:
        with pytest.raises(openai.APITimeoutError):
            await queen.client(timeout=0.5).chat.completions.create(
                model=ECHO_MODEL, messages=USER)
        await asyncio.wait_for(worker.cancelled.wait(), 5)
        session = await _session(queen, worker)
        await queen.wait_until(lambda: session.free_slots == 1, what="slot freed")
    finally:
        await worker.stop()


async def test_first_token_timeout_is_504_and_cancels(tmp_path):
    async with running_queen(tmp_path, first_token_timeout_s=0.3) as queen:
        worker = await ScriptedWorker(queen.ws_url, behaviour="hang").start()
        try:
            with pytest.raises(openai.APIStatusError) as caught:
                await queen.client().chat.completions.create(
                    model=ECHO_MODEL, messages=USER, stream=True)
            assert caught.value.status_code == 504
            assert caught.value.code == "first_token_timeout"
            await asyncio.wait_for(worker.cancelled.wait(), 5)
        finally:
            await worker.stop()


async def test_total_timeout_is_504_and_cancels(tmp_path):
    async with running_queen(tmp_path, total_timeout_s=0.4) as queen:
        worker = await ScriptedWorker(queen.ws_url, behaviour="hang").start()
        try:
            with pytest.raises(openai.APIStatusError) as caught:
                await queen.client().chat.completions.create(model=ECHO_MODEL, messages=USER)
            assert caught.value.status_code == 504
            assert caught.value.code == "timeout"
            await asyncio.wait_for(worker.cancelled.wait(), 5)
        finally:
            await worker.stop()


async def test_busy_swarm_queues_then_serves(queen):
    worker = await ScriptedWorker(queen.ws_url, behaviour="gated", max_jobs=1).start()
    try:
        client = queen.client()
        first = asyncio.create_task(client.chat.completions.create(
            model=ECHO_MODEL, messages=USER, stream=True))
        await asyncio.wait_for(worker.job_arrived.wait(), 5)
        second = asyncio.create_task(client.chat.completions.create(
            model=ECHO_MODEL, messages=[{"role": "user", "content": "second"}]))
        await queen.wait_until(lambda: queen.state.registry.waiting == 1, what="queued")
        worker.release.set()
        stream = await first
        assert "".join([c.choices[0].delta.content or "" async for c in stream
                        if c.choices]) == "echo: hi there"
        assert (await second).choices[0].message.content == "echo: second"
    finally:
        await worker.stop()


async def test_busy_swarm_past_queue_timeout_is_503_with_retry_after(tmp_path):
    async with running_queen(tmp_path, queue_timeout_s=0.2, retry_after_s=7) as queen:
        worker = await ScriptedWorker(queen.ws_url, behaviour="gated", max_jobs=1).start()
        try:
            first = asyncio.create_task(queen.client().chat.completions.create(
                model=ECHO_MODEL, messages=USER, stream=True))
            await asyncio.wait_for(worker.job_arrived.wait(), 5)
            async with httpx.AsyncClient(base_url=queen.base_url) as http:
                response = await http.post("/v1/chat/completions",
                                           json={"model": ECHO_MODEL, "messages": USER})
            assert response.status_code == 503
            assert response.headers["retry-after"] == "7"
            assert response.json()["error"]["code"] == "no_capacity"
            worker.release.set()
            stream = await first
            assert [c async for c in stream]
        finally:
            await worker.stop()


async def test_worker_lost_mid_stream_ends_with_an_error_event(queen):
    worker = await ScriptedWorker(queen.ws_url, behaviour="gated").start()
    body = {"model": ECHO_MODEL, "messages": USER, "stream": True}
    async with httpx.AsyncClient(base_url=queen.base_url) as http, \
            http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.aiter_lines()
        async for line in lines:
            if line.startswith("data: {"):
                break
        await worker.stop()  # the worker vanishes after the first token
        rest = [line async for line in lines if line.startswith("data: ")]
    assert rest, "the stream must not end silently"
    assert '"worker_lost"' in rest[-1]
    assert "[DONE]" not in rest[-1]


async def test_frames_for_jobs_that_are_not_the_workers_are_dropped(queen):
    intruder = await ScriptedWorker(queen.ws_url, behaviour="gated").start()
    victim = await ScriptedWorker(queen.ws_url, loaded=False).start()
    try:
        # Occupy the intruder so the next job goes to the victim, then forge frames for it.
        first = asyncio.create_task(queen.client().chat.completions.create(
            model=ECHO_MODEL, messages=USER, stream=True))
        await asyncio.wait_for(intruder.job_arrived.wait(), 5)
        second = asyncio.create_task(queen.client().chat.completions.create(
            model=ECHO_MODEL, messages=[{"role": "user", "content": "mine"}]))
        await queen.wait_until(lambda: len(victim.jobs) == 1, what="victim has the job")
        forged = encode(Result(
            id=victim.jobs[0].id, usage=Usage(prompt_tokens=1, total_tokens=1),
            data={"choices": [{"index": 0, "message": {"role": "assistant",
                                                       "content": "forged"}}]}))
        await intruder.send_raw(forged)
        intruder.release.set()
        assert (await second).choices[0].message.content == "echo: mine"
        await first
        assert len(queen.state.registry) == 2
    finally:
        await intruder.stop()
        await victim.stop()
