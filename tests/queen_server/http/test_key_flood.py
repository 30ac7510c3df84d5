"""One key cannot fill the queue: the adversary against a real queen over real sockets.

A scripted worker with one slot holds its job open (``gated``) so that everything else must
wait in the admission queue. Key A floods; its extra requests get 429 at once, while key B is
still admitted and served once the slot frees; afterwards no caller is counted any more, however
its requests ended (answered, refused, timed out, cancelled, client gone)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from starlette.requests import Request

from queen_server.billing.keys import hash_secret
from queen_server.billing.service import DEV_NAME, OPEN, Principal
from queen_server.http.generation import caller_of
from tests.support.queen import QueenHarness, running_queen
from tests.support.workers import ECHO_MODEL, ScriptedWorker

CHAT = {"model": ECHO_MODEL, "messages": [{"role": "user", "content": "hello there"}]}
KEY_A, KEY_B = "key-a", "key-b"
CALLER_A, CALLER_B = "dev:" + hash_secret(KEY_A), "dev:" + hash_secret(KEY_B)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def settled(queen: QueenHarness) -> None:
    """Every caller's counts are back to zero (and forgotten), and nobody waits."""
    dispatcher = queen.state.dispatcher
    await queen.wait_until(lambda: len(dispatcher.callers) == 0 and queen.state.registry.waiting
                           == 0, timeout_s=10, what="no caller counted")


async def test_a_flooding_key_gets_429_while_another_key_is_served(tmp_path):
    async with running_queen(tmp_path, auth="keys", api_keys=[KEY_A, KEY_B],
                             max_queued_per_key=2, max_concurrent_per_key=8,
                             queue_timeout_s=20.0, first_token_timeout_s=20.0,
                             total_timeout_s=30.0) as queen:
        worker = await ScriptedWorker(queen.ws_url, behaviour="gated").start()
        callers = queen.state.dispatcher.callers
        try:
            async with httpx.AsyncClient(base_url=queen.base_url, timeout=30) as http:
                def chat(key: str) -> asyncio.Task[httpx.Response]:
                    return asyncio.create_task(http.post("/v1/chat/completions", json=CHAT,
                                                         headers=auth(key)))

                busy = chat(KEY_A)  # takes the only slot and holds it
                await queen.wait_until(lambda: len(worker.jobs) == 1, what="the slot taken")
                flood = [chat(KEY_A) for _ in range(12)]
                refused = []
                async with asyncio.timeout(10):  # at once: nobody sits out the queue timeout
                    for next_done in asyncio.as_completed(flood):
                        refused.append(await next_done)
                        if len(refused) == 10:
                            break
                assert [r.status_code for r in refused] == [429] * 10
                for response in refused:
                    assert response.headers["retry-after"] == "5"
                    error = response.json()["error"]
                    assert error["type"] == "rate_limit_error"
                    assert error["code"] in {"too_many_queued_requests",
                                             "too_many_concurrent_requests"}
                assert callers.queued(CALLER_A) == 2  # its share of the queue, no more
                assert sum(not task.done() for task in flood) == 2
                assert queen.state.registry.waiting == 2

                other = chat(KEY_B)  # another key is still admitted while A floods
                await queen.wait_until(lambda: callers.queued(CALLER_B) == 1,
                                       what="key B queued")
                assert not other.done()
                worker.release.set()  # capacity frees: everyone admitted is served
                answer = await asyncio.wait_for(other, 20)
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["message"]["content"] == "echo: hello there"
                served = await asyncio.gather(busy, *(t for t in flood if not t.done()))
                assert [r.status_code for r in served] == [200] * len(served)
                assert len(worker.jobs) == 4  # no refused request ever reached the worker
            await settled(queen)
        finally:
            await worker.stop()


async def test_no_count_leaks_after_timeouts_cancels_and_clients_gone(tmp_path):
    async with running_queen(tmp_path, auth="keys", api_keys=[KEY_A],
                             max_queued_per_key=2, max_concurrent_per_key=3,
                             queue_timeout_s=1.0) as queen:
        worker = await ScriptedWorker(queen.ws_url, behaviour="gated").start()
        callers = queen.state.dispatcher.callers
        try:
            async with httpx.AsyncClient(base_url=queen.base_url, timeout=30) as http:
                # A stream holds the slot (its first chunk is out, the rest gated).
                async with http.stream("POST", "/v1/chat/completions",
                                       json={**CHAT, "stream": True},
                                       headers=auth(KEY_A)) as stream:
                    assert stream.status_code == 200
                    chunks = stream.aiter_bytes()  # kept: a dropped iterator closes the stream
                    await anext(chunks)
                    assert callers.in_flight(CALLER_A) == 1

                    # A queued request whose client goes away gives its places back.
                    gone = asyncio.create_task(http.post("/v1/chat/completions", json=CHAT,
                                                         headers=auth(KEY_A)))
                    await queen.wait_until(lambda: callers.queued(CALLER_A) == 1,
                                           what="a request queued")
                    gone.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await gone
                    await queen.wait_until(lambda: callers.in_flight(CALLER_A) == 1,
                                           what="the gone client's place given back")
                    assert callers.queued(CALLER_A) == 0

                    # A queued request that times out (503) gives its places back.
                    late = await http.post("/v1/chat/completions", json=CHAT,
                                           headers=auth(KEY_A))
                    assert late.status_code == 503
                    assert callers.in_flight(CALLER_A) == 1
                    assert callers.queued(CALLER_A) == 0
                # The stream's client left mid-answer.
                await settled(queen)

                # A running plain request whose client goes away (the worker gets a cancel).
                await queen.wait_until(lambda: queen.state.registry.leased == 0,
                                       what="the slot back")
                running = asyncio.create_task(http.post("/v1/chat/completions", json=CHAT,
                                                        headers=auth(KEY_A)))
                await queen.wait_until(lambda: len(worker.jobs) == 2, what="the job running")
                assert callers.in_flight(CALLER_A) == 1
                running.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await running
                await settled(queen)
                assert len(worker.cancels) == 2
        finally:
            await worker.stop()


async def test_open_access_callers_are_counted_by_address_on_both_routes(tmp_path):
    async with running_queen(tmp_path, max_concurrent_per_key=1) as queen:
        worker = await ScriptedWorker(queen.ws_url, behaviour="gated").start()
        try:
            async with httpx.AsyncClient(base_url=queen.base_url, timeout=30) as http:
                busy = asyncio.create_task(http.post("/v1/chat/completions", json=CHAT))
                await queen.wait_until(lambda: len(worker.jobs) == 1, what="the slot taken")
                # Another key, unknown to an open queen, is the same address all the same.
                for path, body in (("/v1/chat/completions", CHAT),
                                   ("/v1/embeddings", {"model": ECHO_MODEL, "input": "x"})):
                    response = await http.post(path, json=body, headers=auth("made-up"))
                    assert response.status_code == 429, response.text
                    assert response.json()["error"]["code"] == "too_many_concurrent_requests"
                assert queen.state.dispatcher.callers.in_flight("addr:127.0.0.1") == 1
                worker.release.set()
                assert (await busy).status_code == 200
                embedded = await http.post("/v1/embeddings",
                                           json={"model": ECHO_MODEL, "input": "x"})
                assert embedded.status_code == 200
            await settled(queen)
        finally:
            await worker.stop()


def request_from(address: str, authorization: str | None) -> Request:
    headers = [(b"authorization", authorization.encode())] if authorization else []
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers,
                    "client": (address, 4000)})


def dev(secret: str) -> Principal:
    """What ``Billing.authenticate`` answers for a development key."""
    return Principal(DEV_NAME, digest=hash_secret(secret))


def test_the_caller_is_the_key_the_dev_key_or_the_address():
    keyed = Principal("mine", key=SimpleNamespace(id=42))  # type: ignore[arg-type]
    assert caller_of(request_from("10.0.0.1", "Bearer s1"), keyed) == "key:42"
    assert caller_of(request_from("10.0.0.2", "Bearer s1"), keyed) == "key:42"
    dev_one = caller_of(request_from("10.0.0.1", "Bearer dev-1"), dev("dev-1"))
    assert dev_one == "dev:" + hash_secret("dev-1")
    assert caller_of(request_from("10.0.0.1", "Bearer dev-2"), dev("dev-2")) != dev_one
    assert caller_of(request_from("10.0.0.9", "Bearer whatever"), OPEN) == "addr:10.0.0.9"
    assert caller_of(request_from("10.0.0.9", None), OPEN) == "addr:10.0.0.9"
