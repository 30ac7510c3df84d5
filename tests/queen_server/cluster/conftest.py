"""Every cluster test runs against both implementations: the in-process ones (one queen, no
Redis) and the Redis ones against a real ``redis-server`` (``tests.support.redis_server``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from queen_server.cluster.bus import Bus, InProcessBus, RedisBus
from tests.support.redis_server import RedisServer, bus_seal


@pytest.fixture(params=["memory", "redis"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def redis_or_none(kind: str, request: pytest.FixtureRequest) -> RedisServer | None:
    if kind == "memory":
        return None
    return request.getfixturevalue("redis_server")


@pytest.fixture
async def bus_factory(redis_or_none: RedisServer | None
                      ) -> AsyncIterator[Callable[[], Awaitable[Bus]]]:
    """Makes buses that see each other: one shared in-process bus, or one ``RedisBus`` per
    call (as separate replicas would have) on the same redis-server."""
    made: list[Bus] = []
    shared = InProcessBus()

    async def make() -> Bus:
        if redis_or_none is None:
            return shared
        bus = await RedisBus(redis_or_none.url, seal=bus_seal(), reconnect_s=0.02,
                             max_reconnect_s=0.2).start()
        made.append(bus)
        return bus

    yield make
    for bus in made:
        await bus.close()
    await shared.close()


async def until(condition: Callable[[], Any], within_s: float = 5.0, what: str = "") -> None:
    """Poll ``condition`` until it is true (a wait on a condition, with a deadline)."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        await asyncio.sleep(0.01)
