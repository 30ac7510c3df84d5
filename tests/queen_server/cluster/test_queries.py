"""Reports across replicas (``cluster.queries``): one replica asks, the others answer with
their parts; a replica that is slow, broken or gone is left out after the timeout, never
waited on forever; garbage on the channels is dropped. On the in-process bus and on a real
redis-server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from queen_server.cluster.bus import Bus
from queen_server.cluster.queries import Queries, answer_channel, query_channel
from queen_server.cluster.remote import DEFAULT_NAMESPACE
from shared_schema.cluster import ClusterAnswer, encode_cluster

Made = Callable[..., Awaitable[Queries]]


@pytest.fixture
async def make(bus_factory: Callable[[], Awaitable[Bus]]) -> AsyncIterator[Made]:
    made: list[Queries] = []

    async def replica(name: str, answer: Callable[[str, str | None], Awaitable[Any]],
                      timeout_s: float = 2.0) -> Queries:
        queries = await Queries(await bus_factory(), name, answer, timeout_s=timeout_s).start()
        made.append(queries)
        return queries

    yield replica
    for queries in made:
        await queries.close()


def answering(name: str) -> Callable[[str, str | None], Awaitable[Any]]:
    async def answer(what: str, arg: str | None) -> Any:
        return {"replica": name, "what": what, "arg": arg}
    return answer


async def test_every_other_replica_answers_with_its_part(make: Made) -> None:
    asker = await make("a", answering("a"))
    await make("b", answering("b"))
    await make("c", answering("c"))
    answers = await asker.ask("worker", "w1")
    assert answers == {"b": {"replica": "b", "what": "worker", "arg": "w1"},
                       "c": {"replica": "c", "what": "worker", "arg": "w1"}}


async def test_a_lone_replica_gets_no_answers_and_does_not_wait(make: Made) -> None:
    asker = await make("a", answering("a"), timeout_s=30.0)
    started = time.monotonic()
    assert await asker.ask("totals") == {}
    assert time.monotonic() - started < 5  # the broadcast said nobody else listens


async def test_a_replica_that_fails_to_answer_is_left_out_at_once(make: Made) -> None:
    async def broken(what: str, arg: str | None) -> Any:
        raise RuntimeError("its database is down")

    asker = await make("a", answering("a"), timeout_s=30.0)
    await make("b", answering("b"))
    await make("c", broken)
    started = time.monotonic()
    answers = await asker.ask("jobs")
    assert set(answers) == {"b"}
    assert time.monotonic() - started < 5  # its error counted as its answer


async def test_a_slow_replica_is_left_out_after_the_timeout(make: Made) -> None:
    stuck = asyncio.Event()

    async def slow(what: str, arg: str | None) -> Any:
        await stuck.wait()
        return "too late"

    asker = await make("a", answering("a"), timeout_s=0.3)
    await make("b", answering("b"))
    await make("c", slow)
    answers = await asker.ask("workers")
    assert answers == {"b": {"replica": "b", "what": "workers", "arg": None}}
    stuck.set()


async def test_garbage_and_strays_on_the_query_channels_are_dropped(
        make: Made, bus_factory: Callable[[], Awaitable[Bus]]) -> None:
    asker = await make("a", answering("a"))
    await make("b", answering("b"))
    hostile = await bus_factory()
    await hostile.publish(query_channel(DEFAULT_NAMESPACE), b"{not json")
    await hostile.publish(query_channel(DEFAULT_NAMESPACE), b'{"type": "query", "id": "x"}')
    await hostile.publish(answer_channel("a", DEFAULT_NAMESPACE), b"\xff\xfe")
    # An answer to a question nobody asked: ignored.
    await hostile.publish(answer_channel("a", DEFAULT_NAMESPACE), encode_cluster(
        ClusterAnswer(id="a.999", replica="mallory", data={"workers_online": 10**9})))
    answers = await asker.ask("totals")
    assert answers == {"b": {"replica": "b", "what": "totals", "arg": None}}
