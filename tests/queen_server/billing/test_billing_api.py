"""Billing through the real API: a billed queen, scripted workers, the openai SDK."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from queen_server.billing import ledger
from queen_server.billing.pricing import PriceTable
from queen_server.billing.store import LedgerStore
from queen_server.storage.engine import Database
from tests.support.queen import running_queen
from tests.support.workers import ECHO_MODEL, ScriptedWorker

USER = [{"role": "user", "content": "hi there"}]
TINY = PriceTable().for_parameters(135_000_000)  # the scripted workers' model size


async def funded_key(queen, sats: float, **limits) -> tuple[str, int]:
    billing = queen.state.billing
    secret, record = await billing.keys.create("dev", **limits)
    if sats:
        await billing.ledger.post(ledger.deposit(record.id, round(sats * 1000),
                                                 f"deposit:test:{record.id}"))
    await billing.refresh()
    return secret, record.id


async def balances(queen) -> dict[str, int]:
    return await queen.state.billing.ledger.balances()


@pytest.fixture
async def billed(tmp_path, db_url):
    async with running_queen(tmp_path, auth="keys", db=db_url) as queen:
        worker = await ScriptedWorker(queen.ws_url, max_jobs=64).start()
        yield queen, worker
        await worker.stop()


async def test_a_request_is_charged_its_usage(billed):
    queen, worker = billed
    secret, key_id = await funded_key(queen, 10)
    answer = await queen.client(api_key=secret).chat.completions.create(
        model=ECHO_MODEL, messages=USER, max_tokens=50)
    cost = TINY.cost_msat(answer.usage.prompt_tokens, answer.usage.completion_tokens)
    assert cost > 0
    money = await balances(queen)
    assert money[ledger.key_available(key_id)] == 10_000 - cost
    assert money[ledger.key_reserved(key_id)] == 0
    assert money[ledger.QUEEN_FEES] == cost  # the worker's first job is its proof of work
    assert ledger.worker_pending(worker.pubkey) not in money
    assert (await queen.state.billing.ledger.check()).clean


async def test_escrow_then_available_earnings(tmp_path, db_url):
    async with running_queen(tmp_path, auth="keys", db=db_url, escrow_jobs=2) as queen:
        worker = await ScriptedWorker(queen.ws_url).start()
        try:
            secret, _ = await funded_key(queen, 10)
            client = queen.client(api_key=secret)
            shares = []
            for _ in range(4):
                answer = await client.chat.completions.create(model=ECHO_MODEL, messages=USER)
                cost = TINY.cost_msat(answer.usage.prompt_tokens, answer.usage.completion_tokens)
                shares.append(int(cost * queen.state.settings.worker_share))
            money = await balances(queen)
            # job 1: unpaid proof of work; jobs 2-3: pending, released at the end of the
            # escrow; job 4: straight to available.
            assert money[ledger.worker_pending(worker.pubkey)] == 0
            assert money[ledger.worker_available(worker.pubkey)] == sum(shares[1:])
            assert queen.state.billing._workers[worker.pubkey].jobs == 4
            assert await queen.state.billing.ledger.worker_jobs(worker.pubkey) == 4
            assert (await queen.state.billing.ledger.check()).clean
        finally:
            await worker.stop()


async def test_a_streamed_request_is_charged_its_usage(billed):
    queen, _ = billed
    secret, key_id = await funded_key(queen, 10)
    stream = await queen.client(api_key=secret).chat.completions.create(
        model=ECHO_MODEL, messages=USER, stream=True, stream_options={"include_usage": True})
    usage = [chunk async for chunk in stream][-1].usage
    cost = TINY.cost_msat(usage.prompt_tokens, usage.completion_tokens)
    assert (await balances(queen))[ledger.key_available(key_id)] == 10_000 - cost


async def test_without_enough_balance_the_answer_is_402(billed):
    queen, worker = billed
    secret, key_id = await funded_key(queen, 0.001)
    with pytest.raises(openai.APIStatusError) as caught:
        await queen.client(api_key=secret).chat.completions.create(
            model=ECHO_MODEL, messages=USER, max_tokens=1000)
    assert caught.value.status_code == 402
    assert caught.value.code == "insufficient_balance"
    assert "sats" in caught.value.message
    assert worker.jobs == []
    assert (await balances(queen))[ledger.key_available(key_id)] == 1


async def test_an_unset_max_tokens_is_capped_to_what_the_balance_covers(billed):
    queen, worker = billed
    secret, _ = await funded_key(queen, 0.05)  # 50 msat: about 200 completion tokens
    await queen.client(api_key=secret).chat.completions.create(model=ECHO_MODEL, messages=USER)
    limit = worker.jobs[-1].openai_req["max_tokens"]
    assert 0 < limit < queen.state.settings.default_max_tokens
    assert TINY.cost_msat(len("hi there") + 8, limit) <= 50


async def test_200_concurrent_requests_never_overspend(billed):
    queen, worker = billed
    worker.behaviour = "gated"  # hold every job open so the reservations pile up
    queen.state.settings.max_concurrent_per_key = 0  # 200 in flight from one key, on purpose
    secret, key_id = await funded_key(queen, 0)
    reservation = TINY.cost_msat(len("hi there") + 8, 1000)
    funded = 50 * reservation + reservation // 2
    await queen.state.billing.ledger.post(ledger.deposit(key_id, funded, "deposit:big"))
    await queen.state.billing.refresh()
    client = queen.client(api_key=secret, timeout=30)

    async def one() -> str:
        try:
            await client.chat.completions.create(model=ECHO_MODEL, messages=USER,
                                                 max_tokens=1000)
            return "ok"
        except openai.APIStatusError as exc:
            return str(exc.status_code)

    tasks = [asyncio.create_task(one()) for _ in range(200)]
    await queen.wait_until(lambda: len(worker.jobs) == 50, timeout_s=20, what="50 holds")
    assert sum(task.done() for task in tasks) == 150  # the rest were refused at once
    worker.release.set()
    outcomes = await asyncio.gather(*tasks)
    assert outcomes.count("ok") == 50
    assert outcomes.count("402") == 150
    money = await balances(queen)
    spent = funded - money[ledger.key_available(key_id)]
    assert money[ledger.key_available(key_id)] >= 0
    assert money[ledger.key_reserved(key_id)] == 0
    earned = (money.get(ledger.worker_pending(worker.pubkey), 0)
              + money.get(ledger.worker_available(worker.pubkey), 0))
    assert spent == money[ledger.QUEEN_FEES] + earned
    report = await queen.state.billing.ledger.check()
    assert report.clean, report


async def test_a_failed_job_is_charged_nothing(billed):
    queen, worker = billed
    worker.behaviour = "fatal"
    secret, key_id = await funded_key(queen, 10)
    with pytest.raises(openai.APIStatusError):
        await queen.client(api_key=secret).chat.completions.create(model=ECHO_MODEL,
                                                                   messages=USER)
    money = await balances(queen)
    assert money[ledger.key_available(key_id)] == 10_000
    assert money.get(ledger.QUEEN_FEES, 0) == 0
    assert (await queen.state.billing.ledger.check()).clean


async def test_a_broken_stream_is_charged_only_the_tokens_delivered(billed):
    queen, worker = billed
    worker.behaviour = "gated"
    secret, key_id = await funded_key(queen, 10)
    body = {"model": ECHO_MODEL, "messages": USER, "stream": True, "max_tokens": 500}
    headers = {"Authorization": f"Bearer {secret}"}
    async with httpx.AsyncClient(base_url=queen.base_url) as http, \
            http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        lines = response.aiter_lines()
        async for line in lines:
            if line.startswith("data: {"):
                break  # one token delivered
        await worker.stop()
        [line async for line in lines]
    await queen.wait_until(lambda: queen.state.billing._states[key_id].inflight == 0)
    money = await balances(queen)
    assert money[ledger.key_available(key_id)] == 10_000 - TINY.cost_msat(0, 1)
    assert (await queen.state.billing.ledger.check()).clean


async def test_limits_give_429(billed):
    queen, worker = billed
    worker.behaviour = "gated"
    secret, _ = await funded_key(queen, 10, concurrency_limit=1, rpm_limit=2)
    client = queen.client(api_key=secret)
    first = asyncio.create_task(client.chat.completions.create(
        model=ECHO_MODEL, messages=USER, max_tokens=5))
    await asyncio.wait_for(worker.job_arrived.wait(), 5)
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(model=ECHO_MODEL, messages=USER, max_tokens=5)
    assert caught.value.code == "concurrency_limit_exceeded"
    worker.release.set()
    await first
    await client.chat.completions.create(model=ECHO_MODEL, messages=USER, max_tokens=5)
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(model=ECHO_MODEL, messages=USER, max_tokens=5)
    assert caught.value.code == "rate_limit_exceeded"
    assert int(caught.value.response.headers["retry-after"]) >= 1


async def test_keys_unknown_revoked_and_development(tmp_path, db_url):
    async with running_queen(tmp_path, auth="keys", db=db_url, api_keys="dev-secret") as queen:
        worker = await ScriptedWorker(queen.ws_url).start()
        try:
            with pytest.raises(openai.AuthenticationError):
                await queen.client(api_key="nope").chat.completions.create(
                    model=ECHO_MODEL, messages=USER)
            free = await queen.client(api_key="dev-secret").chat.completions.create(
                model=ECHO_MODEL, messages=USER)
            assert free.choices[0].message.content.startswith("echo:")
            assert await balances(queen) == {}  # development keys are never billed
            secret, key_id = await funded_key(queen, 1)
            await queen.state.billing.keys.revoke(key_id)
            await queen.state.billing.refresh()
            with pytest.raises(openai.AuthenticationError) as caught:
                await queen.client(api_key=secret).models.list()
            assert caught.value.code == "revoked_api_key"
        finally:
            await worker.stop()


async def test_deposits_from_another_process_are_seen_once(billed):
    queen, _ = billed
    secret, key_id = await funded_key(queen, 1)
    client = queen.client(api_key=secret)
    await client.chat.completions.create(model=ECHO_MODEL, messages=USER, max_tokens=2)
    before = queen.state.billing._states[key_id].available
    other = Database(queen.state.db.url.render_as_string(hide_password=False))
    try:
        await LedgerStore(other.engine).post(ledger.deposit(key_id, 7000, "deposit:cli:1"))
    finally:
        await other.close()
    await queen.state.billing.refresh()
    await queen.state.billing.refresh()
    assert queen.state.billing._states[key_id].available == before + 7000


async def test_a_restart_releases_what_a_crash_left_reserved(tmp_path, db_url):
    database = Database(db_url)
    await database.upgrade()
    store = LedgerStore(database.engine)
    await store.post(ledger.deposit(1, 5000, "deposit:1"))
    await store.post(ledger.reserve(1, 3000, "job-in-flight-at-the-crash"))
    await database.close()
    async with running_queen(tmp_path, auth="keys", db=db_url) as queen:
        money = await balances(queen)
        assert money[ledger.key_reserved(1)] == 0
        assert money[ledger.key_available(1)] == 5000
        assert (await queen.state.billing.ledger.check()).clean


async def test_a_spend_budget_caps_what_a_key_can_spend(billed):
    queen, _ = billed
    reservation = TINY.cost_msat(len("hi there") + 8, 100)
    secret, key_id = await funded_key(queen, 100, budget_msat=reservation + 1)
    client = queen.client(api_key=secret)
    first = await client.chat.completions.create(model=ECHO_MODEL, messages=USER,
                                                 max_tokens=100)
    spent = TINY.cost_msat(first.usage.prompt_tokens, first.usage.completion_tokens)
    assert spent > 1  # so the next full reservation cannot fit in what is left
    with pytest.raises(openai.APIStatusError) as caught:
        await client.chat.completions.create(model=ECHO_MODEL, messages=USER, max_tokens=100)
    assert caught.value.status_code == 402
    assert caught.value.code == "budget_exceeded"
    assert queen.state.billing._states[key_id].spent == spent
    assert await queen.state.billing.ledger.key_spent(key_id) == spent


async def test_n_choices_reserve_n_answers_so_a_key_cannot_overspend_with_n(tmp_path, db_url):
    """A key that can pay for one 1,000-token answer but not eight asks for n=8: refused with
    402 before any worker runs, since each choice may be 1,000 tokens long."""
    async with running_queen(tmp_path, auth="keys", db=db_url) as queen:
        worker = await ScriptedWorker(queen.ws_url, capabilities=["choices"]).start()
        try:
            prompt = len(USER[0]["content"]) + 8  # the hold's estimate of the prompt
            secret, _ = await funded_key(queen, TINY.cost_msat(prompt, 4000) / 1000)
            client = queen.client(api_key=secret)
            with pytest.raises(openai.APIStatusError) as caught:
                await client.chat.completions.create(model=ECHO_MODEL, messages=USER,
                                                     max_tokens=1000, n=8)
            assert caught.value.status_code == 402
            assert worker.jobs == []
            await client.chat.completions.create(model=ECHO_MODEL, messages=USER,
                                                 max_tokens=1000, n=2)
            assert worker.jobs[0].openai_req["n"] == 2
        finally:
            await worker.stop()


async def test_a_refund_after_the_escrow_was_forfeited_comes_from_the_queen(tmp_path, db_url):
    """A flagged worker's escrow goes to the queen; refunding one of its jobs afterwards must
    not drive its accounts below zero: the queen, which holds the forfeit, gives it back."""
    async with running_queen(tmp_path, auth="keys", db=db_url, escrow_jobs=5) as queen:
        worker = await ScriptedWorker(queen.ws_url).start()
        billing = queen.state.billing
        secret, key_id = await funded_key(queen, 10)
        client = queen.client(api_key=secret)
        first = await client.chat.completions.create(model=ECHO_MODEL, messages=USER,
                                                     max_tokens=50)
        second = await client.chat.completions.create(model=ECHO_MODEL, messages=USER,
                                                      max_tokens=50)
        money = await balances(queen)
        assert money[ledger.worker_pending(worker.pubkey)] > 0
        assert await billing.forfeit_escrow(worker.pubkey, 1) > 0
        charge = TINY.cost_msat(second.usage.prompt_tokens, second.usage.completion_tokens)
        assert await billing.refund(second.id) == charge
        assert await billing.refund(second.id) == 0  # once
        money = await balances(queen)
        assert money[ledger.worker_pending(worker.pubkey)] == 0
        assert money.get(ledger.worker_available(worker.pubkey), 0) == 0
        first_cost = TINY.cost_msat(first.usage.prompt_tokens, first.usage.completion_tokens)
        assert money[ledger.key_available(key_id)] == 10_000 - first_cost  # the second is back
        assert (await billing.ledger.check()).clean
        await worker.stop()
