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
same way. ``send`` writes commands at once and returns one future a reply, resolved in order;
a connection that breaks fails every reply still owed with ``ConnectionError``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import hiredis
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection, parse_url

Arg = bytes | str | int


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


class _Replies(asyncio.Protocol):
    """The transport's side: replies parsed as bytes arrive, handed to the waiting futures in
    the order their commands were written."""

    def __init__(self, on_push: Callable[[Any], None] | None = None) -> None:
        self.reader = hiredis.Reader()
        self.waiting: deque[asyncio.Future[Any]] = deque()
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
            future = waiting.popleft()
            if not future.done():
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"the connection to Redis was lost ({exc or 'closed'})"))

    def _fail(self, error: Exception) -> None:
        if self.lost is None:  # the first reason is the one that says why
            self.lost = error
        error = self.lost
        if not self.closed.done():
            self.closed.set_result(None)
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(error)


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

    def send(self, commands: Sequence[bytes]) -> list[asyncio.Future[Any]]:
        """Write ``commands`` (each ``pack``ed) in one buffer; a future for each reply (a
        ``hiredis.ReplyError`` is a reply, not an exception)."""
        protocol = self._protocol
        if protocol.lost is not None:
            raise protocol.lost
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in commands]
        protocol.waiting.extend(futures)
        self._transport.write(b"".join(commands))
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
    the relays of many jobs cost one write and one wake-up between them, and an idle bus sends
    at once. The connection is made on first use and again after it broke; a publish that
    failed with it raises ``ConnectionError`` (the bus retries it once)."""

    __slots__ = ("_closed", "_connection", "_queue", "_task", "timeout_s", "url", "writes")

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._connection: RespConnection | None = None
        self._queue: list[tuple[list[bytes], asyncio.Future[list[int]]]] = []
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.writes = 0  # writes made (each carries every publish queued since the last)

    async def ping(self) -> None:
        """Connect (if not yet) and check that Redis answers."""
        connection = await self._connected()
        reply = await connection.send([pack("PING")])[0]
        if isinstance(reply, hiredis.ReplyError):
            raise ConnectionError(f"Redis refused PING: {reply}")

    async def publish(self, channel: str, items: Sequence[bytes]) -> list[int]:
        """Publish each of ``items`` to ``channel``, in order; the receivers of each."""
        if self._closed:
            raise ConnectionError("the publisher is closed")
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._queue.append(([pack("PUBLISH", channel, data) for data in items], future))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain(),
                                                                name="redis-bus-publisher")
        return await future

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

    async def _drain(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []
            replies: list[asyncio.Future[Any]] = []
            try:
                connection = await self._connected()
                replies = connection.send([command for commands, _ in batch
                                           for command in commands])
                self.writes += 1
                await replies[-1]  # replies come in order: every earlier one is in too
            except BaseException as exc:
                self._fail(batch, replies, exc)
                if not isinstance(exc, Exception):
                    raise
                continue
            at = 0
            for commands, future in batch:
                counts = [reply.result() for reply in replies[at:at + len(commands)]]
                at += len(commands)
                refused = next((c for c in counts if isinstance(c, hiredis.ReplyError)), None)
                if future.done():
                    continue
                if refused is not None:
                    future.set_exception(ConnectionError(f"Redis refused PUBLISH: {refused}"))
                else:
                    future.set_result([int(count) for count in counts])

    def _fail(self, batch: list[tuple[list[bytes], asyncio.Future[list[int]]]],
              replies: list[asyncio.Future[Any]], exc: BaseException) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
        for reply in replies:  # retrieved, so none is reported as never retrieved
            if reply.done() and not reply.cancelled():
                reply.exception()
        error = exc if isinstance(exc, OSError) else ConnectionError(
            f"publishing to Redis failed: {exc!r}")
        for _, future in batch:
            if not future.done():
                future.set_exception(error)

    async def close(self) -> None:
        self._closed = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._fail(self._queue, [], ConnectionError("the publisher is closed"))
        self._queue = []
