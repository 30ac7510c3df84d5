"""The directory, in memory (with a clock the test moves) and in a real redis-server (whose
keys expire by Redis's own clock), through the same cases."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
import redis.exceptions

from queen_server.cluster.directory import (
    Capacity,
    Directory,
    MemoryDirectory,
    RedisDirectory,
    ReplicaInfo,
    rank_replicas,
    swarm_counts,
)
from tests.support.redis_server import RedisServer

TTL_S = 0.3


@dataclass
class Setup:
    directory: Directory
    other: Directory  # a second replica's view of the same directory
    pass_ttl: Callable[[], Awaitable[None]]  # let every entry's time to live pass


@pytest.fixture
async def setup(redis_or_none: RedisServer | None) -> AsyncIterator[Setup]:
    if redis_or_none is None:
        now = [0.0]
        directory = MemoryDirectory(ttl_s=TTL_S, clock=lambda: now[0])

        async def advance() -> None:
            now[0] += TTL_S + 0.01

        yield Setup(directory, directory, advance)
        return
    one = RedisDirectory(redis_or_none.url, ttl_s=TTL_S, namespace="t")
    two = RedisDirectory(redis_or_none.url, ttl_s=TTL_S, namespace="t")

    async def wait_ttl() -> None:
        # Redis expires a key by its own clock: this waits for the very thing under test.
        await asyncio.sleep(TTL_S + 0.05)

    yield Setup(one, two, wait_ttl)
    await one.close()
    await two.close()


async def test_replicas_are_alive_while_they_beat(setup: Setup) -> None:
    d = setup.directory
    await d.heartbeat(ReplicaInfo("a", "http://a", workers=3, jobs_in_flight=1))
    await setup.other.heartbeat(ReplicaInfo("b", "http://b", workers=2))
    alive = await d.alive()
    assert set(alive) == {"a", "b"}
    assert alive["a"] == ReplicaInfo("a", "http://a", workers=3, jobs_in_flight=1)
    counts = swarm_counts(await setup.other.alive())
    assert (counts.replicas, counts.workers, counts.jobs_in_flight) == (2, 5, 1)
    await setup.pass_ttl()
    await d.heartbeat(ReplicaInfo("a", "http://a"))  # only a keeps beating
    assert set(await setup.other.alive()) == {"a"}


async def test_a_removed_replica_is_gone_at_once_with_its_capacity(setup: Setup) -> None:
    d = setup.directory
    await d.heartbeat(ReplicaInfo("a"))
    await d.publish_capacity("a", {"m": Capacity(2, 1, 0.02)})
    await d.remove_replica("a")
    assert await d.alive() == {}
    assert await setup.other.replicas_for("m") == []


async def test_a_worker_is_claimed_taken_over_and_released_by_its_owner(setup: Setup) -> None:
    a, b = setup.directory, setup.other
    assert await a.claim_worker("w1", "A") is None
    assert await b.owner("w1") == "A"
    assert await a.claim_worker("w1", "A") is None  # a reconnect to the same replica
    # The worker reconnects to B: B takes it over and learns A held it.
    assert await b.claim_worker("w1", "B") == "A"
    assert await a.owner("w1") == "B"
    # A's refresh no longer extends it, and tells A it lost it; A cannot release it either.
    assert await a.refresh_workers("A", ["w1"]) == ["w1"]
    assert await a.release_worker("w1", "A") is False
    assert await b.owner("w1") == "B"
    assert await b.release_worker("w1", "B") is True
    assert await a.owner("w1") is None


async def test_a_dead_owners_workers_expire_and_refreshed_ones_stay(setup: Setup) -> None:
    d = setup.directory
    await d.claim_worker("kept", "A")
    await d.claim_worker("dropped", "A")
    await setup.pass_ttl()
    assert await d.owner("kept") is None  # nobody refreshed: expired
    await d.claim_worker("kept", "A")
    for _ in range(3):
        assert await d.refresh_workers("A", ["kept"]) == []
    await setup.pass_ttl()
    assert await d.owner("kept") is None  # past its TTL unrefreshed (A was cut off, say)
    # The worker is still connected to A and nobody else claimed it: A claims it again, it
    # does not close it (a Redis restarted empty must not drop the whole swarm).
    assert await d.refresh_workers("A", ["kept"]) == []
    assert await setup.other.owner("kept") == "A"
    await setup.pass_ttl()
    await setup.other.claim_worker("kept", "B")  # it reconnected to B meanwhile: B's now
    assert await d.refresh_workers("A", ["kept"]) == ["kept"]
    assert await d.owner("kept") == "B"


async def test_many_workers_refresh_in_one_call(setup: Setup) -> None:
    d = setup.directory
    d.ttl_s = setup.other.ttl_s = 30.0  # type: ignore[attr-defined]  (claiming takes a while)
    keys = [f"w{i}" for i in range(2500)]  # more than one script run's batch
    for key in keys:
        await d.claim_worker(key, "A")
    await setup.other.claim_worker("w7", "B")
    assert await d.refresh_workers("A", keys) == ["w7"]


async def test_capacity_is_ranked_and_only_from_live_replicas(setup: Setup) -> None:
    a, b = setup.directory, setup.other
    for replica in ("A", "B", "C"):
        await a.heartbeat(ReplicaInfo(replica))
    await a.publish_capacity("A", {"m": Capacity(holders=3, free_slots=0, best_s_per_token=0.01),
                                   "n": Capacity(1, 1)})
    await b.publish_capacity("B", {"m": Capacity(2, 2, 0.05)})
    await b.publish_capacity("C", {"m": Capacity(1, 1, 0.02)})
    ranked = await b.replicas_for("m")
    assert [r for r, _ in ranked] == ["C", "B", "A"]  # free first, then the fastest
    assert ranked[0][1] == Capacity(1, 1, 0.02)
    assert [r for r, _ in await a.replicas_for("m", exclude=["C"])] == ["B", "A"]
    assert await a.replicas_for("unknown") == []
    # A stops serving n: its summary goes.
    await a.publish_capacity("A", {"m": Capacity(3, 1, 0.01)})
    assert await a.replicas_for("n") == []
    assert next(r for r, _ in await a.replicas_for("m")) == "A"
    # Only A keeps beating: B's and C's summaries are ignored, then reaped.
    await setup.pass_ttl()
    await a.heartbeat(ReplicaInfo("A"))
    assert [r for r, _ in await b.replicas_for("m")] == ["A"]
    assert set(await b.alive()) == {"A"}


def test_ranking_puts_unmeasured_after_measured_and_busy_last() -> None:
    ranked = rank_replicas([("busy", Capacity(5, 0, 0.001)), ("new", Capacity(1, 3, None)),
                            ("slow", Capacity(1, 1, 0.1)), ("fast", Capacity(1, 1, 0.01)),
                            ("fast2", Capacity(1, 4, 0.01))])
    assert [r for r, _ in ranked] == ["fast2", "fast", "slow", "new", "busy"]


async def test_memory_directory_close_is_harmless() -> None:
    d = MemoryDirectory()
    await d.close()
    assert await d.alive() == {}


async def test_a_redis_restarted_empty_gets_every_owners_workers_back_on_its_refresh(
        redis_server: RedisServer) -> None:
    a = RedisDirectory(redis_server.url, ttl_s=30.0, namespace="t")
    b = RedisDirectory(redis_server.url, ttl_s=30.0, namespace="t")
    try:
        await a.claim_worker("w1", "A")
        await a.claim_worker("w2", "A")
        await b.claim_worker("w3", "B")
        redis_server.restart()  # every entry gone; the workers are still connected
        for client in (a, b):  # the first command after the restart meets the dead socket
            with contextlib.suppress(redis.exceptions.ConnectionError):
                await client.owner("w1")
        assert await a.refresh_workers("A", ["w1", "w2"]) == []  # none closed
        assert await b.refresh_workers("B", ["w3"]) == []
        assert [await b.owner(key) for key in ("w1", "w2", "w3")] == ["A", "A", "B"]
    finally:
        await a.close()
        await b.close()
