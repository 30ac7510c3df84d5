"""The cluster bus: publish bytes to a channel, subscribe to a channel's messages.

``InProcessBus`` serves one queen with no Redis (everything in the process, nothing lost);
``RedisBus`` carries messages between replicas with Redis pub/sub. Both hand out the same
``Subscription``: an async iterator of ``bytes`` messages and ``BusGap`` markers.

A ``BusGap`` says messages may have been lost at that point of the stream, so the reader must
not assume it saw everything. Pub/sub is at-most-once: while the connection to Redis is down,
whatever was published is gone. ``RedisBus`` reconnects and resubscribes by itself (with
backoff), and puts a ``BusGap`` in every subscription when the connection drops, so a
cross-replica stream fails loudly (``cluster.stream``) rather than arriving shorter.

Only the replicas speak on it (issue 40): ``RedisBus`` seals every message it publishes with the
replicas' shared secret (``seal.BusSeal``: an HMAC over the channel, the time and the bytes) and
drops, counted and logged, every message it reads that is not sealed so: a forged job or
outcome that someone with Redis's password publishes never reaches a reader.

Backpressure: each subscription holds at most ``limit`` messages. When a reader falls that far
behind, newer messages are dropped (counted) and one ``BusGap`` marks the place, after the
messages already held: memory stays bounded, and the loss is never silent. Publishing never
waits on a slow reader. A subscription made with a ``handler`` holds nothing: each message (or
``BusGap``) is handed to it as it is read, with no task woken per message (the relay's replies,
``cluster.remote``); the handler must not block.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from queen_server.cluster.errors import BusUnavailable
from queen_server.cluster.resp import Published, Publisher, RespConnection, awaited
from queen_server.cluster.seal import BusSeal

log = logging.getLogger(__name__)

DEFAULT_QUEUE_LIMIT = 4096
REFUSED_LOG_EVERY_S = 60.0  # at most one warning a minute about unsealed messages


@dataclass(frozen=True, slots=True)
class BusGap:
    """Messages may have been lost here (a reconnect, or this reader fell behind)."""

    reason: str


BusItem = bytes | BusGap


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


Handler = Callable[[BusItem], None]


class Subscription:
    """One reader's messages on one channel, bounded (see the module's docstring)."""

    __slots__ = ("_closed", "_handler", "_items", "_on_close", "_overflowing", "_waiter",
                 "channel", "dropped", "limit")

    def __init__(self, channel: str, limit: int = DEFAULT_QUEUE_LIMIT,
                 on_close: Callable[[Subscription], None] | None = None,
                 handler: Handler | None = None) -> None:
        if limit < 1:
            raise ValueError("a subscription must hold at least one message")
        self.channel = channel
        self.limit = limit
        self.dropped = 0  # messages dropped because this reader fell behind
        self._items: deque[BusItem] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._overflowing = False
        self._closed = False
        self._on_close = on_close
        self._handler = handler

    def _hand(self, item: BusItem) -> None:
        try:
            self._handler(item)  # type: ignore[misc]
        except Exception:  # the handler's bug must not stop the bus's reader
            log.exception("the handler of %s failed", self.channel)

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, data: bytes) -> None:
        """Hand one message to this reader (the bus calls it; never blocks)."""
        if self._closed:
            return
        if self._handler is not None:
            self._hand(data)
            return
        if self._overflowing or len(self._items) >= self.limit:
            self.dropped += 1
            if not self._overflowing:
                self._overflowing = True
                self._items.append(BusGap(f"the reader of {self.channel} fell behind "
                                          f"({self.limit} messages waiting); messages dropped"))
                self._notify()
            return
        self._items.append(data)
        self._notify()

    def put_gap(self, reason: str) -> None:
        """Mark that messages may have been lost here (one marker for a run of them)."""
        if self._closed or (self._items and isinstance(self._items[-1], BusGap)):
            return
        if self._handler is not None:
            self._hand(BusGap(reason))
            return
        self._items.append(BusGap(reason))
        self._notify()

    def _notify(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take_ready(self) -> list[BusItem]:
        """Every item already waiting, without blocking."""
        items = list(self._items)
        self._items.clear()
        self._overflowing = False
        return items

    async def get(self, timeout: float | None = None) -> BusItem:  # noqa: ASYNC109
        """The next item; ``TimeoutError`` after ``timeout`` seconds; ``BusUnavailable`` once
        the subscription (or its bus) is closed."""
        while not self._items:
            if self._closed:
                raise BusUnavailable(f"the subscription to {self.channel} is closed")
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()
            self._waiter = waiter
            timer = None if timeout is None else loop.call_later(timeout, _wake, waiter)
            try:
                await waiter
            finally:
                if timer is not None:
                    timer.cancel()
                self._waiter = None
            if not self._items and not self._closed and timeout is not None:
                raise TimeoutError
        item = self._items.popleft()
        if isinstance(item, BusGap):
            self._overflowing = False  # the reader saw the marker: later messages are kept
        return item

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> BusItem:
        try:
            return await self.get()
        except BusUnavailable:
            raise StopAsyncIteration from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._notify()
        if self._on_close is not None:
            self._on_close(self)


class Bus(Protocol):
    async def start(self) -> Bus:
        """Connect (if there is anything to connect to); ``BusUnavailable`` if it cannot."""
        ...

    async def publish(self, channel: str, data: bytes) -> int:
        """Send ``data`` to every current subscriber of ``channel``; the number of receivers
        (processes for Redis, subscriptions in process). ``BusUnavailable`` when it cannot
        be sent."""
        ...

    async def publish_many(self, channel: str, items: Sequence[bytes]) -> list[int]:
        """``publish`` each of ``items`` in order, in one round trip where the bus has them;
        the receivers of each."""
        ...

    def publish_soon(self, channel: str, items: Sequence[bytes], done: Published) -> None:
        """``publish_many`` without waiting: ``done`` is called once, later, with the receivers
        of each item or with ``BusUnavailable``; in order with every other publish of this
        bus. ``BusUnavailable`` at once if the bus is closed. (The relay's hot path: nothing
        is made per message but the message.)"""
        ...

    async def subscribe(self, channel: str, limit: int = DEFAULT_QUEUE_LIMIT,
                        handler: Handler | None = None) -> Subscription:
        """A new reader of ``channel``, subscribed when this returns; with ``handler``, every
        message is handed to it as it is read instead of held."""
        ...

    async def close(self) -> None: ...


class InProcessBus:
    """The bus of a single queen: direct hand-off to the subscriptions in this process."""

    def __init__(self) -> None:
        self._subs: dict[str, set[Subscription]] = {}
        self._closed = False

    async def start(self) -> InProcessBus:
        return self  # nothing to connect to

    async def publish(self, channel: str, data: bytes) -> int:
        return self._deliver(channel, data)

    def _deliver(self, channel: str, data: bytes) -> int:
        if self._closed:
            raise BusUnavailable("the bus is closed")
        subs = tuple(self._subs.get(channel, ()))
        for sub in subs:
            sub.put(data)
        return len(subs)

    async def publish_many(self, channel: str, items: Sequence[bytes]) -> list[int]:
        return [await self.publish(channel, data) for data in items]

    def publish_soon(self, channel: str, items: Sequence[bytes], done: Published) -> None:
        counts = [self._deliver(channel, data) for data in items]
        asyncio.get_running_loop().call_soon(done, counts)

    async def subscribe(self, channel: str, limit: int = DEFAULT_QUEUE_LIMIT,
                        handler: Handler | None = None) -> Subscription:
        if self._closed:
            raise BusUnavailable("the bus is closed")
        sub = Subscription(channel, limit, self._forget, handler)
        self._subs.setdefault(channel, set()).add(sub)
        return sub

    def _forget(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.channel)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.channel]

    async def close(self) -> None:
        self._closed = True
        for subs in list(self._subs.values()):
            for sub in list(subs):
                sub.close()


class RedisBus:
    """The bus over Redis pub/sub: one connection publishes, one reads every channel this
    process subscribes to and hands each message to the local subscriptions of its channel.
    Both are ``resp.RespConnection``s (issue 40): a message is parsed by hiredis and handed on
    in the transport's own callback, with no task or await per message.

    The reading connection has no retries of its own: when it breaks, the reader puts a
    ``BusGap`` in every subscription, reconnects with backoff (``reconnect_s`` up to
    ``max_reconnect_s``) and resubscribes every channel, so no reconnect goes unmarked.
    """

    def __init__(self, url: str, *, seal: BusSeal, reconnect_s: float = 0.05,
                 max_reconnect_s: float = 2.0, subscribe_timeout_s: float = 5.0) -> None:
        self.url = url
        self.seal = seal
        self.refused = 0  # messages read that were not sealed with the replicas' secret
        self._refused_logged_at = float("-inf")
        self.reconnect_s = reconnect_s
        self.max_reconnect_s = max_reconnect_s
        self.subscribe_timeout_s = subscribe_timeout_s
        self._publisher = Publisher(url)  # the hot path: every publish, coalesced
        self._subs: dict[str, set[Subscription]] = {}
        self._confirmed: dict[str, asyncio.Future[None]] = {}
        self._reader: RespConnection | None = None  # the subscribed connection, while up
        self._live: set[str] = set()  # channels Redis confirmed on the current connection
        self._wanted = asyncio.Event()  # set when some channel is wanted
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.reconnects = 0  # connections made after the first (for logs and tests)

    async def start(self) -> RedisBus:
        """Check Redis answers and start the reader. ``BusUnavailable`` if it does not."""
        try:
            await self._publisher.ping()
        except (OSError, ValueError) as exc:
            raise BusUnavailable(f"Redis at {self.url} did not answer: {exc}") from exc
        self._task = asyncio.create_task(self._read_forever(), name="redis-bus-reader")
        return self

    async def publish(self, channel: str, data: bytes) -> int:
        return (await self.publish_many(channel, (data,)))[0]

    async def publish_many(self, channel: str, items: Sequence[bytes]) -> list[int]:
        return await awaited(partial(self.publish_soon, channel, items))

    def publish_soon(self, channel: str, items: Sequence[bytes], done: Published) -> None:
        """In order, coalesced with every other publish of this process into one write
        (``resp.Publisher``). A connection that died with a Redis restart fails once; the retry
        takes a fresh one (a message that then arrives twice is harmless: its reader drops it,
        jobs by id and events by sequence number)."""
        if self._closed:
            raise BusUnavailable("the bus is closed")
        sealed = [self.seal.seal(channel, data) for data in items]

        def finish(result: list[int] | Exception) -> None:
            """The answer ``done`` gets: the receivers, or any failure as ``BusUnavailable``."""
            if isinstance(result, Exception) and not isinstance(result, BusUnavailable):
                log.debug("publishing %d to %s failed (%s)", len(items), channel, result)
                result = BusUnavailable(f"publishing to {channel} failed: {result}")
            done(result)

        def first(result: list[int] | Exception) -> None:
            if isinstance(result, OSError) and not self._closed:
                log.debug("publishing %d to %s failed (%s); again on a fresh connection",
                          len(items), channel, result)
                try:
                    self._publisher.publish_soon(channel, sealed, finish)
                except OSError as exc:
                    finish(exc)
                return
            finish(result)

        try:
            self._publisher.publish_soon(channel, sealed, first)
        except OSError as exc:  # closed meanwhile
            raise BusUnavailable(f"publishing to {channel} failed: {exc}") from exc

    async def subscribe(self, channel: str, limit: int = DEFAULT_QUEUE_LIMIT,
                        handler: Handler | None = None) -> Subscription:
        if self._closed or self._task is None:
            raise BusUnavailable("the bus is closed or not started")
        sub = Subscription(channel, limit, self._forget, handler)
        subs = self._subs.setdefault(channel, set())
        subs.add(sub)
        confirmed = self._confirmed.get(channel)
        if confirmed is None:
            confirmed = asyncio.get_running_loop().create_future()
            self._confirmed[channel] = confirmed
            if self._reader is not None:  # else the reader subscribes it when it connects
                self._reader.subscribe(channel)
            self._wanted.set()
        try:
            await asyncio.wait_for(asyncio.shield(confirmed), self.subscribe_timeout_s)
        except TimeoutError:
            sub.close()
            raise BusUnavailable(f"subscribing to {channel} on {self.url} timed out") from None
        return sub

    def _forget(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.channel)
        if subs is None:
            return
        subs.discard(sub)
        if subs or self._closed:
            return
        del self._subs[sub.channel]
        confirmed = self._confirmed.pop(sub.channel, None)
        if confirmed is not None and not confirmed.done():
            confirmed.cancel()
        if self._reader is not None:
            self._reader.unsubscribe(sub.channel)

    def _gap_all(self, reason: str) -> None:
        for subs in self._subs.values():
            for sub in subs:
                sub.put_gap(reason)

    async def _read_forever(self) -> None:
        delay = self.reconnect_s
        connected_before = False
        while not self._closed:
            if not self._subs:
                self._wanted.clear()
                await self._wanted.wait()
                continue
            self._live = set()
            reader: RespConnection | None = None
            try:
                reader = await RespConnection.open(self.url, on_push=self._on_push)
                reader.subscribe(*self._subs)
                self._reader = reader
                if connected_before:
                    self.reconnects += 1
                    log.info("cluster bus reconnected to Redis; %d channels resubscribed",
                             len(self._subs))
                connected_before = True
                delay = self.reconnect_s
                raise await reader.wait_closed()
            except asyncio.CancelledError:
                raise
            except (OSError, ValueError) as exc:
                if self._closed:
                    break
                log.warning("cluster bus lost Redis (%s); reconnecting in %.2f s", exc, delay)
                self._gap_all(f"the Redis connection was lost ({exc}); messages may have "
                              "been lost")
            finally:
                self._reader = None
                if reader is not None:
                    reader.close()
            if not self._closed:
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_reconnect_s)

    def _on_push(self, reply: Any) -> None:
        """One push on the reading connection, as hiredis parsed it: a message
        (``[b"message", channel, data]``) or Redis confirming a subscription."""
        if not isinstance(reply, list) or len(reply) < 3:
            return
        kind, channel = reply[0], reply[1]
        channel = channel.decode() if isinstance(channel, bytes) else str(channel)
        if kind == b"message":
            data = self.seal.open(channel, reply[2])
            if data is None:
                self._refuse(channel)
                return
            for sub in tuple(self._subs.get(channel, ())):
                sub.put(data)
        elif kind == b"subscribe":
            self._live.add(channel)
            confirmed = self._confirmed.get(channel)
            if confirmed is not None and not confirmed.done():
                confirmed.set_result(None)
        elif kind == b"unsubscribe":
            self._live.discard(channel)

    def _refuse(self, channel: str) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._refused_logged_at >= REFUSED_LOG_EVERY_S:
            self._refused_logged_at = now
            log.warning("cluster bus: dropped a message on %s that is not sealed with this "
                        "cluster's secret (forged, altered, stale, or from a replica with "
                        "another APIARY_CLUSTER_SECRET); %d so far", channel, self.refused)

    @property
    def connected(self) -> bool:
        """Whether every channel wanted here is subscribed on a live connection (after a
        reconnect, False until Redis confirmed them all again)."""
        return self._reader is not None and self._live >= self._subs.keys()

    async def close(self) -> None:
        self._closed = True
        for subs in list(self._subs.values()):
            for sub in list(subs):
                sub.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self._publisher.close()
        if self._reader is not None:
            self._reader.close()
