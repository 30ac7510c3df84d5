"""The cluster bus, in process and over a real redis-server, through the same cases."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from queen_server.cluster.bus import Bus, BusGap, InProcessBus, RedisBus, Subscription
from queen_server.cluster.errors import BusUnavailable
from tests.queen_server.cluster.conftest import until
from tests.support.redis_server import RedisServer, bus_seal

BusFactory = Callable[[], Awaitable[Bus]]


async def test_messages_reach_every_subscriber_in_order(bus_factory: BusFactory) -> None:
    a, b = await bus_factory(), await bus_factory()
    first = await a.subscribe("ch")
    second = await b.subscribe("ch")
    messages = [f"m{i}".encode() for i in range(500)]
    receivers = 0
    for message in messages:
        receivers = await b.publish("ch", message)
    assert receivers >= 1
    for sub in (first, second):
        got = [await sub.get(timeout=5) for _ in messages]
        assert got == messages


async def test_a_handler_gets_each_message_as_read_and_its_failure_stops_nothing(
        bus_factory: BusFactory, caplog: pytest.LogCaptureFixture) -> None:
    """A subscription with a handler (the relay's replies) holds nothing: every message goes
    to the handler in order, with no reader task; a handler that raises on one message is
    logged and still gets the next, and the bus's other subscriptions are untouched."""
    reader, writer = await bus_factory(), await bus_factory()
    got: list[bytes] = []
    last = asyncio.get_running_loop().create_future()

    def handler(item: bytes | BusGap) -> None:
        assert isinstance(item, bytes)
        if item == b"m3":
            raise RuntimeError("a buggy handler")
        got.append(item)
        if item == b"m199" and not last.done():
            last.set_result(None)

    handled = await reader.subscribe("ch", handler=handler)
    plain = await reader.subscribe("ch")
    messages = [f"m{i}".encode() for i in range(200)]
    for at in range(0, len(messages), 7):
        counts: list[int] = []
        done = asyncio.get_running_loop().create_future()
        writer.publish_soon("ch", messages[at:at + 7], done.set_result)
        counts = await asyncio.wait_for(done, 5)
        assert all(count >= 1 for count in counts)
    await asyncio.wait_for(last, 5)
    assert got == [m for m in messages if m != b"m3"]
    assert "a buggy handler" in caplog.text
    assert [await plain.get(timeout=5) for _ in messages] == messages
    assert handled.take_ready() == []  # nothing was held


async def test_nobody_listening_is_zero_receivers(bus_factory: BusFactory) -> None:
    bus = await bus_factory()
    await bus.subscribe("other")
    assert await bus.publish("nobody", b"x") == 0


async def test_a_closed_subscription_ends_its_iteration_and_stops_receiving(
        bus_factory: BusFactory) -> None:
    bus = await bus_factory()
    sub = await bus.subscribe("ch")
    assert await bus.publish("ch", b"one") == 1
    assert await sub.get(timeout=5) == b"one"
    sub.close()
    assert [item async for item in sub] == []
    with pytest.raises(BusUnavailable):
        await sub.get(timeout=1)

    async def nobody() -> bool:
        return await bus.publish("ch", b"x") == 0

    for _ in range(500):  # Redis unsubscribes in the background
        if await nobody():
            break
        await asyncio.sleep(0.01)
    assert await nobody()


async def test_a_reader_that_falls_behind_gets_a_gap_not_unbounded_memory(
        bus_factory: BusFactory) -> None:
    bus = await bus_factory()
    slow = await bus.subscribe("ch", limit=5)
    for i in range(20):
        await bus.publish("ch", f"{i}".encode())
    await until(lambda: slow.dropped == 15, what="15 messages dropped")
    got = slow.take_ready()
    assert got[:5] == [b"0", b"1", b"2", b"3", b"4"]
    assert len(got) == 6
    assert isinstance(got[5], BusGap)
    assert "fell behind" in got[5].reason
    await bus.publish("ch", b"after")  # once it caught up, it receives again
    assert await slow.get(timeout=5) == b"after"


async def test_get_times_out_when_nothing_comes(bus_factory: BusFactory) -> None:
    bus = await bus_factory()
    sub = await bus.subscribe("quiet")
    with pytest.raises(TimeoutError):
        await sub.get(timeout=0.05)


async def test_closing_the_bus_ends_its_subscriptions(bus_factory: BusFactory) -> None:
    bus = await bus_factory()
    sub = await bus.subscribe("ch")
    await bus.close()
    with pytest.raises(BusUnavailable):
        await sub.get(timeout=1)
    with pytest.raises(BusUnavailable):
        await bus.publish("ch", b"x")


def test_a_subscription_must_hold_something() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Subscription("ch", limit=0)


async def test_in_process_publish_after_close_refused() -> None:
    bus = InProcessBus()
    await bus.close()
    with pytest.raises(BusUnavailable):
        await bus.subscribe("ch")


async def test_redis_restart_marks_a_gap_and_resubscribes(redis_server: RedisServer) -> None:
    reader = await RedisBus(redis_server.url, seal=bus_seal(), reconnect_s=0.02,
                            max_reconnect_s=0.2).start()
    writer = await RedisBus(redis_server.url, seal=bus_seal()).start()
    try:
        sub = await reader.subscribe("ch")
        await writer.publish("ch", b"before")
        assert await sub.get(timeout=5) == b"before"
        redis_server.restart()
        gap = await sub.get(timeout=10)
        assert isinstance(gap, BusGap), gap
        # Resubscribed by itself: a publish reaches the same subscription again.
        for _ in range(500):
            try:
                if await writer.publish("ch", b"after") >= 1:
                    break
            except BusUnavailable:  # the writer's own connection is re-established too
                pass
            await asyncio.sleep(0.02)
        item = await sub.get(timeout=5)
        while isinstance(item, BusGap):
            item = await sub.get(timeout=5)
        assert item == b"after"
        assert reader.reconnects >= 1
    finally:
        await reader.close()
        await writer.close()


async def test_a_handler_is_told_of_a_gap_when_redis_restarts(redis_server: RedisServer) -> None:
    reader = await RedisBus(redis_server.url, seal=bus_seal(), reconnect_s=0.02,
                            max_reconnect_s=0.2).start()
    try:
        gaps: asyncio.Queue[BusGap] = asyncio.Queue()
        await reader.subscribe("ch", handler=lambda item: isinstance(item, BusGap)
                               and gaps.put_nowait(item))
        await asyncio.to_thread(redis_server.restart)
        gap = await asyncio.wait_for(gaps.get(), 10)
        assert "lost" in gap.reason
    finally:
        await reader.close()


async def test_redis_bus_refuses_to_start_without_redis(redis_server: RedisServer) -> None:
    redis_server.stop(kill=True)
    with pytest.raises(BusUnavailable, match="did not answer"):
        await RedisBus(redis_server.url, seal=bus_seal()).start()


async def test_a_subscription_made_while_redis_is_down_times_out_loudly(
        redis_server: RedisServer) -> None:
    bus = await RedisBus(redis_server.url, seal=bus_seal(), subscribe_timeout_s=0.3).start()
    try:
        redis_server.stop(kill=True)
        with pytest.raises(BusUnavailable, match="timed out"):
            await bus.subscribe("ch")
    finally:
        await bus.close()
