"""A lean Redis connection for the bus's hot path (issue 40): commands written as one buffer,
replies read by hiredis's C parser in the transport's callback, with no task, timeout or pool
per command.

The relay sends every token a worker streams to another replica's client across Redis, so the
cost of one ``PUBLISH`` is paid thousands of times a second. redis-py's command path (a pool,
retries, a timeout and an await per reply) costs about 54 µs of CPU a message in a pipeline of
8 on the development VM; this connection costs about 12 (``bench/RESULTS.md``, "The relay's
own Redis connections"). The bus publishes (``Publisher``) and reads its pub/sub messages
(``RespConnection.subscribe``, each message handed on from the transport's callback) this way;
everything else (the directory, the queries) stays on redis-py.

``RespConnection.open(url)`` understands what ``APIARY_REDIS_URL`` may be (``redis://``,
``rediss://`` with redis-py's TLS options, ``unix://``): the URL is read by redis-py itself
(``parse_url`` and its connection classes), so both clients connect to the same place the
same way. ``send_batch`` writes commands at once and calls back once with all their replies,
in order (``send`` is the same with one future a reply); a connection that breaks fails every
reply still owed with ``ConnectionError``.

The publishing path has no task and no future per message: ``Publisher.publish_soon`` queues,
writes what is queued at the end of the loop's current round (or when the last write's
replies are in), and calls back from the transport's callback with the receivers of each
message. ``Publisher.publish`` is the awaitable form.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import hiredis
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection, parse_url

log = logging.getLogger(__name__)

Arg = bytes | str | int
# Called once with a write's replies in order (a ``hiredis.ReplyError`` is a reply), or with
# the exception that broke the connection before they all came.
Replied = Callable[[list[Any] | Exception], None]
# Called once with the receivers of each message published, or why they were not published.
Published = Callable[[list[int] | Exception], None]


def pack(*args: Arg) -> bytes:
    """One command in the Redis protocol (an array of bulk strings)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif isinstance(arg, int):
            arg = b"%d" % arg
        out.append(b"$%d\r\n" % len(arg))
        out.append(arg)
        out.append(b"\r\n")
    return b"".join(out)


async def awaited(publish_soon: Callable[[Published], None]) -> list[int]:
    """Wait for a publish made with a callback: the receivers of each message, or its failure
    raised."""
    future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()

    def done(result: list[int] | Exception) -> None:
        if future.done():
            return
        if isinstance(result, Exception):
            future.set_exception(result)
        else:
            future.set_result(result)

    publish_soon(done)
    return await future


class _Batch:
    """The replies one write is owed."""

    __slots__ = ("done", "replies", "size")

    def __init__(self, size: int, done: Replied) -> None:
        self.size = size
        self.done = done
        self.replies: list[Any] = []


def _call(done: Callable[[Any], None], value: Any) -> None:
    """A callback's failure is its own bug: logged, never allowed to break the connection."""
    try:
        done(value)
    except Exception:
        log.exception("a Redis reply's callback failed")


class _Replies(asyncio.Protocol):
    """The transport's side: replies parsed as bytes arrive, handed to the waiting writes in
    the order they were written."""

    def __init__(self, on_push: Callable[[Any], None] | None = None) -> None:
        self.reader = hiredis.Reader()
        self.waiting: deque[_Batch] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost: Exception | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # A subscriber's connection: once it subscribed, every reply is a push (a message, or
        # Redis confirming a (un)subscription), handed to this callback as it is parsed.
        self.on_push = on_push
        self.pushing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        reader.feed(data)
        waiting = self.waiting
        while True:
            reply = reader.gets()
            if reply is False:
                return
            if self.pushing:
                self.on_push(reply)  # type: ignore[misc]
                continue
            if not waiting:  # a reply nobody asked for: the stream is out of step
                self._fail(ConnectionError("Redis sent a reply no command asked for"))
                if self.transport is not None:
                    self.transport.close()
                return
            batch = waiting[0]
            batch.replies.append(reply)
            if len(batch.replies) == batch.size:
                waiting.popleft()
                _call(batch.done, batch.replies)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"the connection to Redis was lost ({exc or 'closed'})"))

    def _fail(self, error: Exception) -> None:
        if self.lost is None:  # the first reason is the one that says why
            self.lost = error
        error = self.lost
        if not self.closed.done():
            self.closed.set_result(None)
        while self.waiting:
            _call(self.waiting.popleft().done, error)


class RespConnection:
    """One connection to Redis that writes commands and reads their replies in order."""

    __slots__ = ("_protocol", "_transport")

    def __init__(self, transport: asyncio.Transport, protocol: _Replies) -> None:
        self._transport = transport
        self._protocol = protocol

    @classmethod
    async def open(cls, url: str, *, timeout_s: float = 5.0,
                   on_push: Callable[[Any], None] | None = None) -> RespConnection:
        """Connect and authenticate as the URL says. ``ConnectionError`` (or ``OSError``,
        ``TimeoutError``) when Redis cannot be reached or refuses the credentials. With
        ``on_push`` it is a subscriber's: after ``subscribe`` every reply goes there."""
        kwargs = parse_url(url)
        connection_class = kwargs.pop("connection_class", None)
        loop = asyncio.get_running_loop()

        def made() -> _Replies:
            return _Replies(on_push)

        async with asyncio.timeout(timeout_s):
            if connection_class is UnixDomainSocketConnection:
                transport, protocol = await loop.create_unix_connection(made, kwargs["path"])
            else:
                ssl = None
                if connection_class is SSLConnection:  # redis-py's reading of the ssl_ options
                    ssl = SSLConnection(**kwargs).ssl_context.get()
                transport, protocol = await loop.create_connection(
                    made, kwargs.get("host", "localhost"), kwargs.get("port", 6379), ssl=ssl)
            connection = cls(transport, protocol)  # type: ignore[arg-type]
            password = kwargs.get("password")
            if password:
                username = kwargs.get("username")
                auth = ("AUTH", username, password) if username else ("AUTH", password)
                try:
                    reply = await connection.send([pack(*auth)])[0]
                except BaseException:
                    connection.close()
                    raise
                if isinstance(reply, hiredis.ReplyError):
                    connection.close()
                    raise ConnectionError(f"Redis refused the credentials: {reply}")
        return connection

    @property
    def usable(self) -> bool:
        return self._protocol.lost is None and not self._transport.is_closing()

    def send_batch(self, commands: Sequence[bytes], done: Replied) -> None:
        """Write ``commands`` (each ``pack``ed) in one buffer; ``done`` is called once, from
        the transport's callback, with their replies in order (or with the connection's
        failure). Raises the connection's failure if it is already broken."""
        protocol = self._protocol
        if protocol.lost is not None:
            raise protocol.lost
        protocol.waiting.append(_Batch(len(commands), done))
        self._transport.write(b"".join(commands))

    def send(self, commands: Sequence[bytes]) -> list[asyncio.Future[Any]]:
        """``send_batch`` with a future for each reply (a ``hiredis.ReplyError`` is a reply,
        not an exception)."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in commands]

        def done(replies: list[Any] | Exception) -> None:
            for at, future in enumerate(futures):
                if future.done():
                    continue
                if isinstance(replies, Exception):
                    future.set_exception(replies)
                else:
                    future.set_result(replies[at])

        self.send_batch(commands, done)
        return futures

    def subscribe(self, *channels: str) -> None:
        """(A subscriber's connection.) Subscribe; from now on every reply is a push."""
        self._protocol.pushing = True
        self.write(pack("SUBSCRIBE", *channels))

    def unsubscribe(self, channel: str) -> None:
        self.write(pack("UNSUBSCRIBE", channel))

    def write(self, command: bytes) -> None:
        """Write a command whose reply is a push (or nobody's)."""
        if self._protocol.lost is None:
            self._transport.write(command)

    async def wait_closed(self) -> Exception:
        """Wait until the connection breaks (or is closed); why."""
        await asyncio.shield(self._protocol.closed)
        return self._protocol.lost or ConnectionError("closed")

    def close(self) -> None:
        self._transport.close()


class Publisher:
    """Every ``PUBLISH`` of this process over one ``RespConnection``, coalesced: what is asked
    while the last write's replies are on their way goes out as the next write, in order. So
    the relays of many jobs cost one write between them, and nothing on the way (no task, no
    future) is made per message. The connection is made on first use and again after it
    broke; a publish that failed with it is told ``ConnectionError`` (the bus retries it
    once)."""

    __slots__ = ("_busy", "_closed", "_connecting", "_connection", "_queue", "timeout_s", "url",
                 "writes")

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._connection: RespConnection | None = None
        self._queue: list[tuple[list[bytes], Published]] = []
        self._busy = False  # a write is due this round, on its way, or the connection is made
        self._connecting: asyncio.Task[None] | None = None
        self._closed = False
        self.writes = 0  # writes made (each carries every publish queued since the last)

    async def ping(self) -> None:
        """Connect (if not yet) and check that Redis answers."""
        connection = await self._connected()
        reply = await connection.send([pack("PING")])[0]
        if isinstance(reply, hiredis.ReplyError):
            raise ConnectionError(f"Redis refused PING: {reply}")

    def publish_soon(self, channel: str, items: Sequence[bytes], done: Published) -> None:
        """Publish each of ``items`` to ``channel``, in order, at the end of this round of the
        loop (or after the write on its way); ``done`` is called once with the receivers of
        each. ``ConnectionError`` at once if the publisher is closed."""
        if self._closed:
            raise ConnectionError("the publisher is closed")
        self._queue.append(([pack("PUBLISH", channel, data) for data in items], done))
        if not self._busy:
            self._busy = True
            asyncio.get_running_loop().call_soon(self._flush)

    async def publish(self, channel: str, items: Sequence[bytes]) -> list[int]:
        """``publish_soon``, awaited: the receivers of each of ``items``."""
        return await awaited(partial(self.publish_soon, channel, items))

    async def _connected(self) -> RespConnection:
        connection = self._connection
        if connection is None or not connection.usable:
            self._connection = None
            connection = await RespConnection.open(self.url, timeout_s=self.timeout_s)
            if self._closed:
                connection.close()
                raise ConnectionError("the publisher is closed")
            self._connection = connection
        return connection

    def _flush(self) -> None:
        """Write everything queued (``_busy`` is set); idle again when nothing is."""
        if not self._queue or self._closed:
            self._busy = False
            return
        connection = self._connection
        if connection is None or not connection.usable:
            self._connecting = asyncio.get_running_loop().create_task(
                self._connect_and_flush(), name="redis-bus-publisher-connect")
            return
        batch, self._queue = self._queue, []
        commands = [command for commands, _ in batch for command in commands]
        try:
            connection.send_batch(commands, partial(self._replied, batch))
        except OSError as exc:  # it broke since it was checked
            self._replied(batch, exc)
            return
        self.writes += 1

    async def _connect_and_flush(self) -> None:
        try:
            await self._connected()
        except Exception as exc:  # every publish waiting is told, whatever broke: none hangs
            queued, self._queue = self._queue, []
            self._busy = False
            self._answer(queued, exc)
            return
        self._flush()

    def _replied(self, batch: list[tuple[list[bytes], Published]],
                 replies: list[Any] | Exception) -> None:
        if isinstance(replies, Exception) and self._connection is not None:
            self._connection.close()  # broken: the next write makes a fresh one
            self._connection = None
        self._answer(batch, replies)
        self._flush()  # what was queued meanwhile

    @staticmethod
    def _answer(batch: list[tuple[list[bytes], Published]],
                replies: list[Any] | Exception) -> None:
        if isinstance(replies, Exception):
            error = replies if isinstance(replies, OSError) else ConnectionError(
                f"publishing to Redis failed: {replies!r}")
            for _, done in batch:
                _call(done, error)
            return
        at = 0
        for commands, done in batch:
            counts = replies[at:at + len(commands)]
            at += len(commands)
            refused = next((c for c in counts if isinstance(c, hiredis.ReplyError)), None)
            if refused is not None:
                _call(done, ConnectionError(f"Redis refused PUBLISH: {refused}"))
            else:
                _call(done, [int(count) for count in counts])

    async def close(self) -> None:
        self._closed = True
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._connecting
        queued, self._queue = self._queue, []
        self._answer(queued, ConnectionError("the publisher is closed"))
        if self._connection is not None:
            self._connection.close()  # what is on its way fails with the connection
            self._connection = None
