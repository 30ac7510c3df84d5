"""Money across queen replicas (issue 18): three real queen processes on one PostgreSQL and one
real redis-server, with a scripted worker on each, and one key sprayed from all sides.

- A key limited to 60 requests a minute, asked 180 times round-robin over the three replicas
  (concurrently, in batches), is served exactly 60 times; every other answer is OpenAI's 429
  with a ``Retry-After`` (the limit is one Lua script on Redis's clock, not one per replica).
- A key with credit for exactly N answers, asked many times that at once over the three
  replicas, is served at most N times (here: exactly N, since each answer costs its whole
  hold), its balance never goes below zero, and ``ledger check`` is clean (every hold is a
  guarded conditional update in PostgreSQL).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import pytest

from queen_server.billing import ledger
from tests.support.replicas import (  # noqa: F401  (shared_db is a fixture)
    Balances,
    create_key,
    flat_prices,
    ledger_is_clean,
    shared_db,
    start_replicas,
    swarm_workers,
    until,
)
from tests.support.workers import ECHO_MODEL, ScriptedWorker

pytestmark = pytest.mark.timeout(240)

NAMES = "abc"


async def one_worker_each(ports: dict[str, int], **options: object) -> list[ScriptedWorker]:
    """A scripted worker on every replica, once every replica sees all of them."""
    workers = [await ScriptedWorker(f"ws://127.0.0.1:{port}/worker", **options).start()
               for port in ports.values()]
    await until(lambda: all(swarm_workers(port) == len(workers) for port in ports.values()),
                20, "every replica to see every worker")
    return workers


def assert_openai_error(response: httpx.Response) -> dict:
    """The body is OpenAI's error shape; returns its ``error``."""
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error.get("message"), str), body
    assert error["message"], body
    assert isinstance(error.get("type"), str), body
    assert "code" in error, body
    return error


async def test_a_60_per_minute_limit_sprayed_across_three_replicas_admits_exactly_60(
        tmp_path, redis_server, shared_db):  # noqa: F811
    key = create_key(tmp_path, shared_db, "sixty", "--credit-sats", "100000", "--rpm", "60")
    ports, queens = await start_replicas(tmp_path, shared_db, redis_server.url,
                                         prices_file=str(flat_prices(tmp_path, ECHO_MODEL, 1)))
    workers: list[ScriptedWorker] = []
    try:
        workers = await one_worker_each(ports, max_jobs=8)
        body = {"model": ECHO_MODEL, "max_tokens": 8,
                "messages": [{"role": "user", "content": "count me"}]}
        order = [ports[name] for name in NAMES]
        responses: list[httpx.Response] = []
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=60, headers={
                "Authorization": f"Bearer {key.secret}"}) as http:
            for batch in range(6):  # 6 batches of 30 at once, round-robin over the replicas
                responses += await asyncio.gather(*(
                    http.post(f"http://127.0.0.1:{order[i % 3]}/v1/chat/completions", json=body)
                    for i in range(batch * 30, batch * 30 + 30)))
        spent_s = time.monotonic() - started
        # The window is 60 s: a spray slower than that would rightly admit more than 60.
        assert spent_s < 55, f"the spray took {spent_s:.1f} s, too slow to test a minute"

        statuses = Counter(response.status_code for response in responses)
        assert statuses == {200: 60, 429: 120}, statuses
        for response in responses:
            if response.status_code == 200:
                assert response.json()["choices"][0]["message"]["content"].startswith("echo:")
                continue
            error = assert_openai_error(response)
            assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
            retry_after = int(response.headers["Retry-After"])
            assert 1 <= retry_after <= 60, retry_after
        # Each replica took its share of the spray and refused some of it: one limit, not three.
        for port in order:
            mine = [r for r in responses if r.url.port == port]
            assert len(mine) == 60
        assert sum(len(worker.jobs) for worker in workers) == 60
        ledger_is_clean(tmp_path, shared_db)
    finally:
        for worker in workers:
            await worker.stop()
        for queen in queens.values():
            queen.stop()


async def test_concurrent_spend_from_one_key_across_replicas_never_overspends(
        tmp_path, redis_server, shared_db):  # noqa: F811
    answers = 8  # the key's credit covers exactly this many answers
    tokens = 5  # every answer is exactly this many tokens, and asks for no more
    price_msat = 1_000  # a completion token; the prompt is free (flat_prices)
    hold_msat = tokens * price_msat
    key = create_key(tmp_path, shared_db, "thrifty", "--credit-sats",
                     str(answers * hold_msat // 1000))
    available, reserved = ledger.key_available(key.id), ledger.key_reserved(key.id)
    ports, queens = await start_replicas(
        tmp_path, shared_db, redis_server.url,
        prices_file=str(flat_prices(tmp_path, ECHO_MODEL, price_msat)))
    workers: list[ScriptedWorker] = []
    balances = Balances(shared_db)
    seen: list[int] = []
    done = asyncio.Event()

    async def watch() -> None:
        """The key's balance in the database, read over and over while the spray runs."""
        while not done.is_set():
            seen.append((await balances.of(available))[available])
            await asyncio.sleep(0.01)

    try:
        workers = await one_worker_each(ports, max_jobs=4, tokens_per_answer=tokens)
        assert (await balances.of(available))[available] == answers * hold_msat
        body = {"model": ECHO_MODEL, "max_tokens": tokens,
                "messages": [{"role": "user", "content": "spend"}]}
        order = [ports[name] for name in NAMES]
        watcher = asyncio.create_task(watch())
        async with httpx.AsyncClient(timeout=60, headers={
                "Authorization": f"Bearer {key.secret}"}) as http:
            responses = await asyncio.gather(*(
                http.post(f"http://127.0.0.1:{order[i % 3]}/v1/chat/completions", json=body)
                for i in range(60)))
        done.set()
        await watcher

        statuses = Counter(response.status_code for response in responses)
        # Each answer costs its whole hold, so nothing comes back to serve a ninth.
        assert statuses == {200: answers, 402: 60 - answers}, statuses
        for response in responses:
            if response.status_code == 200:
                assert response.json()["choices"][0]["message"]["content"] == " tok" * tokens
            else:
                error = assert_openai_error(response)
                assert (error["type"], error["code"]) == ("insufficient_quota",
                                                          "insufficient_balance"), error
        assert sum(len(worker.jobs) for worker in workers) == answers
        assert seen, "the balance was never read during the spray"
        assert min(seen) >= 0, seen
        final = await balances.of(available, reserved)
        assert final == {available: 0, reserved: 0}, final
        ledger_is_clean(tmp_path, shared_db)
    finally:
        done.set()
        await balances.close()
        for worker in workers:
            await worker.stop()
        for queen in queens.values():
            queen.stop()
