"""Mid-stream failover: a worker lost mid-answer is replaced by a twin, and the client never
notices. Real queen, real websockets, scripted workers speaking the real protocol."""

from __future__ import annotations

import asyncio

import openai
import pytest

from queen_server.billing import ledger
from queen_server.billing.pricing import PriceTable
from tests.support.queen import QueenHarness, running_queen
from tests.support.sse import sse_events as read_sse
from tests.support.sse import text_of
from tests.support.workers import ECHO_MODEL, ScriptedWorker, echo_words

WORDS = "one two three four five six seven eight"
USER = [{"role": "user", "content": WORDS}]
FULL = "".join(echo_words({"messages": USER}))  # "echo: one two ... eight"
TINY = PriceTable().for_parameters(135_000_000)


async def sse_events(queen: QueenHarness, body: dict, headers: dict | None = None) -> list:
    return await read_sse(queen.base_url, body, headers)


async def lose_first_worker_mid_answer(queen: QueenHarness, request, **twin_kw):
    """Start ``request`` on a worker that streams two tokens and then vanishes; connect the
    twin while the first worker is mid-answer, then let the first one die."""
    first = await ScriptedWorker(queen.ws_url, behaviour="die_mid", continues=True).start()
    task = asyncio.create_task(request)
    async with asyncio.timeout(5):
        await first.job_arrived.wait()
    twin = await ScriptedWorker(queen.ws_url, **{"continues": True, **twin_kw}).start()
    await queen.wait_until(lambda: len(queen.state.registry) == 2, what="twin connected")
    first.release.set()
    async with asyncio.timeout(15):
        result = await task
    return result, twin


async def test_a_stream_goes_on_on_a_twin_when_its_worker_is_lost(queen):
    body = {"model": ECHO_MODEL, "messages": USER, "stream": True,
            "stream_options": {"include_usage": True}}
    events, twin = await lose_first_worker_mid_answer(queen, sse_events(queen, body))
    assert events[-1] == "[DONE]"
    assert not any("error" in event for event in events if isinstance(event, dict))
    assert text_of(events) == FULL  # nothing missing, nothing twice
    roles = [choice["delta"]["role"] for event in events if isinstance(event, dict)
             for choice in event.get("choices") or () if "role" in choice["delta"]]
    assert roles == ["assistant"]  # the twin's opening role is not repeated
    # The twin was asked to continue exactly what the client had, with the original request.
    [job] = twin.jobs
    assert job.continuation == "echo: one"
    assert job.openai_req["messages"] == USER
    assert len({event["id"] for event in events if isinstance(event, dict)}) == 1
    usage = events[-2]["usage"]
    words = len(echo_words({"messages": USER}))
    assert usage == {"prompt_tokens": 7, "completion_tokens": words, "total_tokens": 7 + words}
    assert queen.state.metrics.failovers._value.get() == 1
    await twin.stop()


async def test_a_plain_answer_is_continued_the_same_way(queen):
    client = queen.client()
    request = client.chat.completions.create(model=ECHO_MODEL, messages=USER)
    answer, twin = await lose_first_worker_mid_answer(queen, request)
    assert answer.choices[0].message.content == FULL
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == len(echo_words({"messages": USER}))
    assert twin.jobs[0].continuation == "echo: one"
    await twin.stop()


async def test_max_tokens_is_what_is_left_after_the_delivered_tokens(queen):
    body = {"model": ECHO_MODEL, "messages": USER, "stream": True, "max_tokens": 50}
    events, twin = await lose_first_worker_mid_answer(queen, sse_events(queen, body))
    assert text_of(events) == FULL
    assert twin.jobs[0].openai_req["max_tokens"] == 48
    await twin.stop()


@pytest.mark.parametrize("twin_kw", [
    {"sha256": "77" * 32},  # the same model name, but a different file
    {"continues": False},  # an older worker that cannot continue
])
async def test_without_a_twin_the_stream_ends_with_a_clean_error(queen, twin_kw):
    body = {"model": ECHO_MODEL, "messages": USER, "stream": True}
    events, other = await lose_first_worker_mid_answer(queen, sse_events(queen, body),
                                                       **twin_kw)
    assert text_of(events) == "echo: one"
    assert "[DONE]" not in events
    error = events[-1]["error"]
    assert error["code"] == "worker_lost"
    assert error["type"] == "server_error"
    assert "same model file" in error["message"]
    assert other.jobs == []  # never asked to start over, which would repeat the text
    await queen.wait_until(lambda: all(not s.jobs for s in queen.state.registry),
                           what="leases released")
    await other.stop()


async def test_a_plain_answer_without_a_twin_is_a_502(queen):
    client = queen.client()
    request = client.chat.completions.create(model=ECHO_MODEL, messages=USER)
    with pytest.raises(openai.APIStatusError) as caught:
        await lose_first_worker_mid_answer(queen, request, sha256="77" * 32)
    assert caught.value.status_code == 502
    assert caught.value.body["code"] == "worker_lost"


async def test_failover_bills_once_and_credits_each_worker_its_part(tmp_path):
    async with running_queen(tmp_path, auth="keys", escrow_jobs=0) as queen:
        billing = queen.state.billing
        secret, record = await billing.keys.create("dev")
        await billing.ledger.post(ledger.deposit(record.id, 10_000, "deposit:test"))
        await billing.refresh()
        client = queen.client(api_key=secret)
        # Each worker first serves one job alone: its unpaid proof of work.
        twin = await ScriptedWorker(queen.ws_url, continues=True).start()
        await client.chat.completions.create(model=ECHO_MODEL, messages=USER, max_tokens=40)
        await twin.stop()
        await queen.wait_until(lambda: len(queen.state.registry) == 0, what="twin gone")
        first = await ScriptedWorker(queen.ws_url, continues=True).start()
        await client.chat.completions.create(model=ECHO_MODEL, messages=USER, max_tokens=40)
        await queen.wait_until(lambda: billing._states[record.id].inflight == 0)
        before = await billing.ledger.balances()

        first.behaviour = "die_mid"
        body = {"model": ECHO_MODEL, "messages": USER, "stream": True, "max_tokens": 40,
                "stream_options": {"include_usage": True}}
        task = asyncio.create_task(
            sse_events(queen, body, {"Authorization": f"Bearer {secret}"}))
        async with asyncio.timeout(5):
            while len(first.jobs) < 2:  # noqa: ASYNC110 (the worker has no per-job event)
                await asyncio.sleep(0.01)
        twin = await ScriptedWorker(queen.ws_url, continues=True, key=twin.key).start()
        await queen.wait_until(lambda: len(queen.state.registry) == 2, what="twin back")
        first.release.set()
        events = await asyncio.wait_for(task, 15)
        assert text_of(events) == FULL
        await queen.wait_until(lambda: billing._states[record.id].inflight == 0)
        after = await billing.ledger.balances()

        usage = events[-2]["usage"]
        charge = TINY.cost_msat(usage["prompt_tokens"], usage["completion_tokens"])
        key = ledger.key_available(record.id)
        assert before[key] - after[key] == charge  # the developer pays once, for the answer

        def gained(worker: ScriptedWorker) -> int:
            account = ledger.worker_available(worker.pubkey)
            return after.get(account, 0) - before.get(account, 0)

        first_cost = TINY.cost_msat(7, 2)  # the prompt, and the two tokens it delivered
        twin_cost = TINY.cost_msat(0, usage["completion_tokens"] - 2)
        share = queen.state.settings.worker_share * charge / (first_cost + twin_cost)
        assert gained(first) == int(share * first_cost) > 0
        assert gained(twin) == int(share * twin_cost) > 0
        assert (await billing.ledger.check()).clean
        await twin.stop()
