"""Per-caller admission: the pure counter, and the dispatcher turning its refusals into 429s
and holding a caller's queue places only while its jobs wait. No sockets (see
``tests/queen_server/http/test_key_flood.py`` for the adversary over a real queen)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest

from queen_server.errors import NoCapacity, RateLimited
from queen_server.swarm.admission import IN_FLIGHT, QUEUED, Admission, CallerLimits
from queen_server.swarm.dispatch import Dispatcher
from queen_server.swarm.registry import Registry
from shared_schema import Chunk, JobError
from tests.queen_server.swarm.test_dispatch import Answering, Recorder
from tests.queen_server.swarm.test_jobs_registry import MODEL, make_session


def enter(limits: CallerLimits, caller: str, *, max_in_flight: int = 3,
          max_queued: int = 2) -> Admission | str:
    return limits.try_enter(caller, max_in_flight=max_in_flight, max_queued=max_queued)


def test_a_caller_is_refused_past_its_in_flight_limit_while_another_is_admitted():
    limits = CallerLimits()
    tickets = [enter(limits, "a") for _ in range(3)]
    assert all(isinstance(ticket, Admission) for ticket in tickets)
    assert enter(limits, "a") == IN_FLIGHT
    assert isinstance(enter(limits, "b"), Admission)
    assert limits.in_flight("a") == 3
    assert limits.in_flight("b") == 1


def test_leaving_frees_a_place_and_a_caller_at_zero_is_forgotten():
    limits = CallerLimits()
    first, second = enter(limits, "a"), enter(limits, "a")
    assert isinstance(first, Admission)
    assert isinstance(second, Admission)
    first.leave()
    first.leave()  # idempotent: a second leave does not free a place twice
    assert limits.in_flight("a") == 1
    assert len(limits) == 1
    second.leave()
    assert len(limits) == 0
    assert limits.in_flight("a") == 0


def test_queue_places_are_limited_and_given_back_once():
    limits = CallerLimits()
    tickets = [enter(limits, "a", max_in_flight=0) for _ in range(4)]
    assert all(isinstance(ticket, Admission) for ticket in tickets)
    one, two, three, four = tickets  # type: ignore[misc]
    assert one.try_queue(2)
    assert two.try_queue(2)
    assert one.try_queue(2)  # a ticket already queued keeps its one place
    assert not three.try_queue(2)
    assert limits.queued("a") == 2
    # A caller with a full share of the queue is refused at the door: a new job would only wait.
    assert enter(limits, "a", max_in_flight=0) == QUEUED
    one.unqueue()
    one.unqueue()
    assert limits.queued("a") == 1
    assert three.try_queue(2)
    two.leave()  # leaving also gives back the queue place
    three.leave()
    assert limits.queued("a") == 0
    for ticket in (one, four):
        ticket.leave()
    assert len(limits) == 0


def test_zero_means_no_limit():
    limits = CallerLimits()
    tickets = [enter(limits, "a", max_in_flight=0, max_queued=0) for _ in range(500)]
    assert all(isinstance(ticket, Admission) and ticket.try_queue(0) for ticket in tickets)
    assert limits.queued("a") == 500
    for ticket in tickets:
        assert isinstance(ticket, Admission)
        ticket.leave()
    assert len(limits) == 0


def test_a_left_ticket_takes_no_queue_place():
    limits = CallerLimits()
    ticket = enter(limits, "a")
    assert isinstance(ticket, Admission)
    ticket.leave()
    assert not ticket.try_queue(2)
    assert len(limits) == 0


@dataclass
class Knobs:
    total_timeout_s: float = 5.0
    default_max_tokens: int = 4096
    first_token_timeout_s: float = 5.0
    max_attempts: int = 3
    queue_timeout_s: float = 5.0
    max_queued_jobs: int = 10
    retry_after_s: int = 7
    legacy_workers: str = "on"
    max_queued_per_key: int = 1
    max_concurrent_per_key: int = 3


def busy_swarm() -> tuple[Registry, Dispatcher]:
    registry = Registry()
    worker = make_session("w", loaded=(MODEL,))
    registry.add(worker, Answering(registry, "w", Chunk(id="x", seq=0, data={})))
    return registry, Dispatcher(registry, Knobs(), Recorder(), lambda _model: "tiny",
                                random.Random(0))


async def test_admit_refuses_with_429_and_retry_after():
    _, dispatcher = busy_swarm()
    tickets = [dispatcher.admit("a") for _ in range(3)]
    with pytest.raises(RateLimited) as refused:
        dispatcher.admit("a")
    assert refused.value.status_code == 429
    assert refused.value.code == "too_many_concurrent_requests"
    assert refused.value.headers == {"Retry-After": "7"}
    dispatcher.admit("b").leave()
    for ticket in tickets:
        ticket.leave()
    assert len(dispatcher.callers) == 0


async def test_a_waiting_job_holds_a_queue_place_until_it_gets_a_worker():
    registry, dispatcher = busy_swarm()
    running = dispatcher.admit("a")
    run = await dispatcher.start("c-1", MODEL, "/v1/chat/completions", {}, stream=True,
                                 admission=running)
    assert dispatcher.callers.queued("a") == 0  # it found a slot without waiting

    waiting = dispatcher.admit("a")
    waiter = asyncio.create_task(dispatcher.start("c-2", MODEL, "/v1/chat/completions", {},
                                                  stream=True, admission=waiting))
    async with asyncio.timeout(5):
        while registry.waiting == 0:  # noqa: ASYNC110 (the registry has no event for waiters)
            await asyncio.sleep(0.01)
    assert dispatcher.callers.queued("a") == 1

    third = dispatcher.admit("b")  # another caller may still queue
    other = asyncio.create_task(dispatcher.start("c-3", MODEL, "/v1/chat/completions", {},
                                                 stream=True, admission=third))
    late = dispatcher.callers.try_enter("a", max_in_flight=0, max_queued=0)
    assert isinstance(late, Admission)  # admitted past the door (no limit there) ...
    with pytest.raises(RateLimited) as refused:  # ... but refused a second queue place
        await dispatcher.start("c-4", MODEL, "/v1/chat/completions", {}, stream=True,
                               admission=late)
    assert refused.value.code == "too_many_queued_requests"
    late.leave()
    async with asyncio.timeout(5):
        while registry.waiting < 2:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    assert dispatcher.callers.queued("b") == 1
    other.cancel()  # a client gone while waiting gives its queue place back
    with pytest.raises(asyncio.CancelledError):
        await other
    assert dispatcher.callers.queued("b") == 0

    await run.finish()  # cancelled; the slot comes back when the worker ends the job
    run.handle.feed(JobError(id=run.handle.id, code="cancelled", message="cancelled"))
    second = await asyncio.wait_for(waiter, 5)
    assert dispatcher.callers.queued("a") == 0
    await second.finish()
    second.handle.feed(JobError(id=second.handle.id, code="cancelled", message="cancelled"))
    for ticket in (running, waiting, third):
        ticket.leave()
    assert len(dispatcher.callers) == 0


async def test_a_wait_that_times_out_gives_its_queue_place_back():
    registry, dispatcher = busy_swarm()
    dispatcher.settings.queue_timeout_s = 0.05  # type: ignore[misc]
    first = dispatcher.admit("a")
    run = await dispatcher.start("c-1", MODEL, "/v1/chat/completions", {}, stream=True,
                                 admission=first)
    second = dispatcher.admit("a")
    with pytest.raises(Exception, match="busy"):
        await dispatcher.start("c-2", MODEL, "/v1/chat/completions", {}, stream=True,
                               admission=second)
    assert dispatcher.callers.queued("a") == 0
    second.leave()
    await run.finish()
    first.leave()
    assert len(dispatcher.callers) == 0
    assert registry.waiting == 0


# --- the queue: handed slots, no barging, shedding ----------------------------------------------


async def queued(registry: Registry, count: int) -> None:
    async with asyncio.timeout(5):
        while registry.waiting < count:  # noqa: ASYNC110 (a test's view of the queue)
            await asyncio.sleep(0)


async def test_a_freed_slot_goes_to_the_waiter_not_to_a_request_arriving_just_then():
    registry, dispatcher = busy_swarm()
    first = await dispatcher.start("c-1", MODEL, "/v1/chat/completions", {}, stream=True)
    waiter = asyncio.create_task(dispatcher.start("c-2", MODEL, "/v1/chat/completions", {},
                                                  stream=True))
    await queued(registry, 1)
    # The worker ends its job and, in the same turn, a new request arrives.
    first.handle.feed(JobError(id=first.handle.id, code="cancelled", message="done"))
    await first.finish()
    late = asyncio.create_task(dispatcher.start("c-3", MODEL, "/v1/chat/completions", {},
                                                stream=True))
    second = await asyncio.wait_for(waiter, 5)
    assert second.handle.id == "c-2.1"
    await queued(registry, 1)  # the late one waits its turn
    assert not late.done()
    second.handle.feed(JobError(id=second.handle.id, code="cancelled", message="done"))
    await second.finish()
    third = await asyncio.wait_for(late, 5)
    assert third.handle.id == "c-3.1"
    await third.finish()


async def test_a_waiter_whose_client_left_is_never_dispatched():
    registry, dispatcher = busy_swarm()
    connection = registry.connection("w")
    first = await dispatcher.start("c-1", MODEL, "/v1/chat/completions", {}, stream=True)
    gone = asyncio.create_task(dispatcher.start("c-gone", MODEL, "/v1/chat/completions", {},
                                                stream=True))
    stays = asyncio.create_task(dispatcher.start("c-stays", MODEL, "/v1/chat/completions", {},
                                                 stream=True))
    await queued(registry, 2)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert registry.waiting == 1
    first.handle.feed(JobError(id=first.handle.id, code="cancelled", message="done"))
    await first.finish()
    run = await asyncio.wait_for(stays, 5)
    assert [job[0] for job in connection.jobs] == ["c-1.1", "c-stays.1"]  # type: ignore[union-attr]
    await run.finish()


async def test_a_job_whose_wait_would_pass_the_timeout_is_shed_at_once():
    registry, dispatcher = busy_swarm()
    dispatcher.settings.queue_timeout_s = 2.0  # type: ignore[misc]
    dispatcher.settings.max_queued_per_key = 0  # type: ignore[misc]
    registry.queue.served(MODEL, 1.0)  # a job holds the one slot for a second
    first = await dispatcher.start("c-1", MODEL, "/v1/chat/completions", {}, stream=True)
    waiting = [asyncio.create_task(dispatcher.start(f"c-{n}", MODEL, "/v1/chat/completions",
                                                    {}, stream=True)) for n in (2, 3)]
    await queued(registry, 2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(NoCapacity) as shed:  # two ahead, one slot a second: 3 s > 2 s
        await dispatcher.start("c-4", MODEL, "/v1/chat/completions", {}, stream=True)
    assert loop.time() - started < 1.0  # told now, not after the queue timeout
    assert shed.value.status_code == 503
    assert shed.value.code == "overloaded"
    assert shed.value.headers == {"Retry-After": "1"}
    assert registry.waiting == 2
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    await first.finish()
