"""Failures across queen replicas (issue 18): real queen processes on one PostgreSQL and one real
redis-server, a replica SIGKILLed and Redis restarted while a stream is being relayed.

- SIGKILL of replica A while B relays a stream from A's worker: the stream finishes (on a twin)
  or ends with a clean error, the killed replica's worker (a real ``LinkClient`` with the
  replicas' URLs, rotating through them) is back on another replica within 10 s, the answer is
  billed once and ``ledger check`` is clean.
- A Redis restart while B relays a stream from A's worker: the client gets the whole text or a
  clean error event, never a truncated stream ending in ``[DONE]``; once Redis is back the
  replicas find each other again and B serves a new request with A's worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest

from queen_server.billing import ledger
from tests.support.replicas import (  # noqa: F401  (shared_db is a fixture)
    Balances,
    create_key,
    flat_prices,
    ledger_is_clean,
    local_workers,
    settled_jobs,
    shared_db,
    start_replicas,
    stub_worker_process,
    swarm_workers,
    until,
)
from tests.support.workers import ECHO_MODEL, ScriptedWorker, echo_words

pytestmark = pytest.mark.timeout(240)


@dataclass
class Stream:
    """One streamed chat completion read as it arrives: every ``data:`` payload, parsed (the
    final ``[DONE]`` kept as that string), and an event set once ``mid_after`` content deltas
    have arrived (the test then knows the stream is under way)."""

    port: int
    secret: str
    body: dict[str, Any]
    mid_after: int = 2
    status: int | None = None
    events: list[Any] = field(default_factory=list)
    midway: asyncio.Event = field(default_factory=asyncio.Event)
    error_body: str = ""

    async def read(self) -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.port}",
                                     timeout=60) as http, \
                http.stream("POST", "/v1/chat/completions", json=self.body,
                            headers={"Authorization": f"Bearer {self.secret}"}) as response:
            self.status = response.status_code
            if response.status_code != 200:
                self.error_body = (await response.aread()).decode(errors="replace")
                self.midway.set()
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                self.events.append(payload if payload == "[DONE]" else orjson.loads(payload))
                if len(self.deltas()) >= self.mid_after:
                    self.midway.set()
        self.midway.set()

    def deltas(self) -> list[str]:
        return [choice["delta"]["content"] for event in self.events if isinstance(event, dict)
                for choice in event.get("choices") or () if choice["delta"].get("content")]

    @property
    def text(self) -> str:
        return "".join(self.deltas())

    @property
    def completion_id(self) -> str:
        return next(event["id"] for event in self.events if isinstance(event, dict)
                    and "id" in event)

    def outcome(self, whole: str) -> str:
        """``whole`` (the full text, then ``[DONE]``) or ``error`` (a clean OpenAI error: a
        non-200 answer with the error shape, or an error event ending the stream without
        ``[DONE]``); anything else fails the test: a stream that says it is complete must be."""
        if self.status != 200:
            assert set(orjson.loads(self.error_body)) == {"error"}, self.error_body
            return "error"
        assert self.events, "the stream ended without a single event"
        last = self.events[-1]
        if last == "[DONE]":
            assert self.text == whole, f"a truncated stream ended in [DONE]: {self.text!r}"
            return "whole"
        assert isinstance(last, dict), last
        assert set(last) == {"error"}, f"the stream ended neither whole nor with an error: {last}"
        assert isinstance(last["error"]["message"], str), last
        assert "[DONE]" not in self.events
        assert whole.startswith(self.text), self.text  # what came before the error was true
        return "error"


def words(count: int) -> str:
    return " ".join(f"w{i}" for i in range(count))


async def test_a_killed_replicas_worker_is_back_elsewhere_within_10_s_and_the_books_balance(
        tmp_path, redis_server, shared_db):  # noqa: F811
    key = create_key(tmp_path, shared_db, "killed", "--credit-sats", "1000")
    prices = flat_prices(tmp_path, ECHO_MODEL, 1)
    ports, queens = await start_replicas(tmp_path, shared_db, redis_server.url,
                                         prices_file=str(prices))
    urls = [f"ws://127.0.0.1:{ports[name]}/worker" for name in "abc"]
    # The real link over the three replicas' URLs, A first; 150 ms a token, so the stream lasts.
    roamer = stub_worker_process(tmp_path, urls, "roamer", token_delay_ms=150, max_jobs=2)
    twin: ScriptedWorker | None = None
    balances = Balances(shared_db)
    reading: asyncio.Task[None] | None = None
    try:
        roamer.start()
        await until(lambda: local_workers(ports["a"]) == 1, 30, "the worker to join replica a")
        await until(lambda: swarm_workers(ports["b"]) == 1, 20, "b to see a's worker")
        assert local_workers(ports["b"]) == local_workers(ports["c"]) == 0

        body = {"model": ECHO_MODEL, "stream": True, "max_tokens": 200,
                "messages": [{"role": "user", "content": words(60)}]}
        stream = Stream(ports["b"], key.secret, body)
        reading = asyncio.create_task(stream.read())
        async with asyncio.timeout(30):
            await stream.midway.wait()
        assert stream.status == 200, stream.error_body
        # Mid-stream, C gets a twin (same file, can continue), then A dies with no goodbye.
        twin = await ScriptedWorker(urls[2], continues=True).start()
        await until(lambda: swarm_workers(ports["b"]) == 2, 20, "b to see c's twin")
        assert "[DONE]" not in stream.events, "the stream ended before the kill"
        queens["a"].stop(kill=True)
        killed_at = time.monotonic()

        await until(lambda: local_workers(ports["b"]) + local_workers(ports["c"]) == 2, 10,
                    "the killed replica's worker to reconnect to b or c")
        back_after_s = time.monotonic() - killed_at
        async with asyncio.timeout(30):
            await reading
        ended_after_s = time.monotonic() - killed_at
        whole = "".join(echo_words(body))
        assert stream.outcome(whole) == "whole"  # a twin was there: failover, not an error
        assert ended_after_s < 10, ended_after_s
        assert back_after_s < 10, back_after_s

        # Billed once, by B, for the whole answer; no hold left behind; the books balance.
        settled = [job for job in await settled_jobs(shared_db) if stream.completion_id in job]
        assert len(settled) == 1, settled
        reserved = ledger.key_reserved(key.id)
        assert (await balances.of(reserved))[reserved] == 0
        ledger_is_clean(tmp_path, shared_db)
    finally:
        if reading is not None and not reading.done():
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
        await balances.close()
        if twin is not None:
            await twin.stop()
        roamer.stop()
        for queen in queens.values():
            queen.stop()


async def test_a_redis_restart_mid_stream_never_truncates_silently_and_the_replicas_recover(
        tmp_path, redis_server, shared_db):  # noqa: F811
    key = create_key(tmp_path, shared_db, "restart", "--credit-sats", "1000")
    prices = flat_prices(tmp_path, ECHO_MODEL, 1)
    ports, queens = await start_replicas(tmp_path, shared_db, redis_server.url, names="ab",
                                         prices_file=str(prices))
    worker: ScriptedWorker | None = None
    reading: asyncio.Task[None] | None = None
    try:
        # A's worker streams its first word, then waits for ``release``.
        worker = await ScriptedWorker(f"ws://127.0.0.1:{ports['a']}/worker", max_jobs=2,
                                      behaviour="gated").start()
        await until(lambda: swarm_workers(ports["b"]) == 1, 20, "b to see a's worker")
        assert local_workers(ports["b"]) == 0

        body = {"model": ECHO_MODEL, "stream": True,
                "messages": [{"role": "user", "content": words(30)}]}
        stream = Stream(ports["b"], key.secret, body, mid_after=1)
        reading = asyncio.create_task(stream.read())
        async with asyncio.timeout(30):
            await stream.midway.wait()
        assert stream.status == 200, stream.error_body
        redis_server.restart()  # every connection dropped; an empty Redis on the same port
        worker.release.set()  # the rest of the answer goes out from A after the restart
        async with asyncio.timeout(30):
            await reading
        outcome = stream.outcome("".join(echo_words(body)))
        assert outcome in {"whole", "error"}

        # Recovery: the directory is rebuilt in the new Redis, and B again sends A's worker a
        # job, which crosses the new bus whole.
        await until(lambda: swarm_workers(ports["b"]) == 1, 20,
                    "b to see a's worker in the restarted Redis")
        jobs_before = len(worker.jobs)
        again = Stream(ports["b"], key.secret, {**body, "messages": [
            {"role": "user", "content": words(8)}]})
        async with asyncio.timeout(30):
            await again.read()
        assert again.status == 200, again.error_body
        assert again.outcome("".join(echo_words(again.body))) == "whole"
        assert len(worker.jobs) == jobs_before + 1  # served by A's worker, across the bus
        # The same session all along: the restart closed no worker (its directory entry, lost
        # with Redis's data, was claimed again by A rather than taken as lost).
        assert not worker.closed.is_set()
        assert local_workers(ports["b"]) == 0
        ledger_is_clean(tmp_path, shared_db)
    finally:
        if reading is not None and not reading.done():
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
        if worker is not None:
            await worker.stop()
        for queen in queens.values():
            queen.stop()
