"""A worker's usage is a claim: lying workers against a real billed queen, over real sockets.

A worker answers a short text and claims a million tokens. The developer is charged, the
worker credited, the client told and the speed record kept for at most what the delivered text
could hold (``queen_server.swarm.metering``), never for the claim.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from queen_server.billing import ledger
from queen_server.swarm.metering import END_TOKENS, Meter
from shared_schema import Usage
from tests.queen_server.billing.test_billing_api import TINY, balances, funded_key
from tests.support.queen import running_queen
from tests.support.workers import ECHO_MODEL, LegacyWorker, ScriptedWorker

MILLION = Usage(prompt_tokens=1_000_000, completion_tokens=1_000_000, total_tokens=2_000_000)
HELLO = [{"role": "user", "content": "Hello"}]
FUNDS_SATS = 100


def bound_of(messages: list[dict[str, Any]], text: str, allowance: int) -> tuple[int, int]:
    """The queen's bound for this request and delivered text: (prompt, completion)."""
    meter = Meter.for_chat({"messages": messages}, allowance)
    return meter.prompt_bound, len(text.encode()) + END_TOKENS


async def charged_and_credited(queen, key_id: int, worker_key: str | None) -> tuple[int, int]:
    money = await balances(queen)
    charged = FUNDS_SATS * 1000 - money[ledger.key_available(key_id)]
    credited = 0
    if worker_key is not None:
        credited = (money.get(ledger.worker_available(worker_key), 0)
                    + money.get(ledger.worker_pending(worker_key), 0))
    return charged, credited


@pytest.fixture
async def liar(tmp_path, db_url):
    async with running_queen(tmp_path, auth="keys", db=db_url, escrow_jobs=0) as queen:
        worker = await ScriptedWorker(queen.ws_url, max_jobs=4, claims=MILLION).start()
        yield queen, worker
        await worker.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
async def test_a_worker_claiming_a_million_tokens_is_paid_for_what_it_delivered(liar, stream):
    queen, worker = liar
    secret, key_id = await funded_key(queen, FUNDS_SATS)
    client = queen.client(api_key=secret)
    allowance = queen.state.settings.template_allowance_tokens
    # The first job is the worker's unpaid proof of work; the second is credited.
    for job in range(2):
        before, _ = await charged_and_credited(queen, key_id, worker.pubkey)
        if stream:
            chunks = [chunk async for chunk in await client.chat.completions.create(
                model=ECHO_MODEL, messages=HELLO, max_tokens=2000, stream=True,
                stream_options={"include_usage": True})]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            answer = await client.chat.completions.create(
                model=ECHO_MODEL, messages=HELLO, max_tokens=2000)
            text, usage = answer.choices[0].message.content, answer.usage
        assert text == "echo: Hello"
        prompt_bound, completion_bound = bound_of(HELLO, text, allowance)
        # What the client is told is what it is billed: the bound, not the claim.
        assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_bound, completion_bound)
        charged, credited = await charged_and_credited(queen, key_id, worker.pubkey)
        delivered_cost = TINY.cost_msat(prompt_bound, completion_bound)
        assert charged - before == delivered_cost  # overcharge ratio 1.0 against the bound
        # Before the bound, the claim was charged up to the whole hold.
        assert delivered_cost * 10 < TINY.cost_msat(len("Hello") + 8, 2000)
        if job == 1:
            assert credited == int(delivered_cost * queen.state.settings.worker_share)
    # The speed record counts the queen's tokens too, so the lie buys no rank.
    records = [r for r in queen.state.stats.recent if r.worker_key == worker.pubkey]
    assert len(records) == 2
    assert all(r.completion_tokens == completion_bound for r in records)
    assert (await queen.state.billing.ledger.check()).clean


async def test_a_worker_claiming_fewer_tokens_than_the_bound_is_believed(tmp_path, db_url):
    few = Usage(prompt_tokens=2, completion_tokens=1, total_tokens=3)
    async with running_queen(tmp_path, auth="keys", db=db_url) as queen:
        worker = await ScriptedWorker(queen.ws_url, claims=few).start()
        try:
            secret, key_id = await funded_key(queen, FUNDS_SATS)
            answer = await queen.client(api_key=secret).chat.completions.create(
                model=ECHO_MODEL, messages=HELLO, max_tokens=50)
            assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (2, 1)
            charged, _ = await charged_and_credited(queen, key_id, None)
            assert charged == TINY.cost_msat(2, 1)
        finally:
            await worker.stop()


async def test_a_legacy_worker_claiming_a_million_tokens_is_bounded_too(tmp_path, db_url):
    lie = {"choices": [{"index": 0, "finish_reason": "stop",
                        "message": {"role": "assistant", "content": "Hello"}}],
           "usage": {"prompt_tokens": 1_000_000, "completion_tokens": 1_000_000,
                     "total_tokens": 2_000_000}}
    async with running_queen(tmp_path, auth="keys", db=db_url) as queen:
        worker = await LegacyWorker(queen.ws_url, answer=lambda _request: lie).start()
        try:
            secret, key_id = await funded_key(queen, FUNDS_SATS)
            answer = await queen.client(api_key=secret).chat.completions.create(
                model=ECHO_MODEL, messages=HELLO, max_tokens=2000)
            prompt_bound, completion_bound = bound_of(
                HELLO, "Hello", queen.state.settings.template_allowance_tokens)
            assert answer.usage.completion_tokens == completion_bound == 6
            assert answer.usage.prompt_tokens == prompt_bound
            charged, _ = await charged_and_credited(queen, key_id, None)
            price = queen.state.billing.prices.unverified  # a legacy model is on no hub
            assert charged == price.cost_msat(prompt_bound, completion_bound)
        finally:
            await worker.stop()


async def test_a_client_that_leaves_after_one_token_pays_the_prompt_and_that_token(
        tmp_path, db_url):
    async with running_queen(tmp_path, auth="keys", db=db_url) as queen:
        worker = await ScriptedWorker(queen.ws_url, behaviour="gated").start()
        try:
            secret, key_id = await funded_key(queen, FUNDS_SATS)
            client = queen.client(api_key=secret)
            stream = await client.chat.completions.create(
                model=ECHO_MODEL, messages=HELLO, max_tokens=50, stream=True)
            first = await anext(aiter(stream))
            assert first.choices[0].delta.content == "echo:"
            await stream.close()  # the client leaves; the worker is still generating
            # The stream's end closes the books first, then sends the worker its cancel.
            async with asyncio.timeout(10):
                await worker.cancelled.wait()
            assert queen.state.billing._states[key_id].inflight == 0
            charged, _ = await charged_and_credited(queen, key_id, None)
            meter = Meter.for_chat({"messages": HELLO}, 64)
            assert charged == TINY.cost_msat(meter.prompt_estimate, 1)
            assert meter.prompt_estimate == len("Hello") + 8
        finally:
            worker.release.set()
            await worker.stop()


async def test_a_plain_request_whose_client_leaves_pays_the_prompt_a_worker_read(
        tmp_path, db_url):
    """Not streamed: the client gives up while the worker works. The swarm read its prompt, so
    it pays the hold's estimate of it (a plain answer had delivered no tokens yet)."""
    async with running_queen(tmp_path, auth="keys", db=db_url) as queen:
        worker = await ScriptedWorker(queen.ws_url, behaviour="gated").start()
        try:
            secret, key_id = await funded_key(queen, FUNDS_SATS)
            client = queen.client(api_key=secret)
            request = asyncio.create_task(client.chat.completions.create(
                model=ECHO_MODEL, messages=HELLO, max_tokens=50))
            await queen.wait_until(lambda: len(worker.jobs) == 1, what="the worker's job")
            request.cancel()  # the client leaves: its connection closes
            async with asyncio.timeout(10):
                await worker.cancelled.wait()
            async with asyncio.timeout(10):  # the hold is settled in the ledger
                while (await balances(queen)).get(ledger.key_reserved(key_id)):  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            charged, _ = await charged_and_credited(queen, key_id, None)
            meter = Meter.for_chat({"messages": HELLO}, 64)
            assert charged == TINY.cost_msat(meter.prompt_estimate, 0)
            assert charged > 0
        finally:
            worker.release.set()
            await worker.stop()
