"""A member's gate: the only way in to its llama.cpp RPC server (issue 19).

The RPC server listens on 127.0.0.1 and has no authentication. The gate listens where the head
can reach it (127.0.0.1 unless the caller passes a LAN address), sends each connection a fresh
challenge (``handshake.py``), lets in only the head the queen named, answering with the
group's one-time token, and then pipes bytes between that connection and the RPC port until
either side closes. Nobody else gets a single byte through: the RPC port is dialled only after
the answer verified.

The pieces are reusable over any reader/writer pair, not only a listening socket, because the
relayed route carries the same bytes through the queen's websocket: ``authenticate_head`` (the
gate's side of the handshake), ``authenticate_member`` (the head's side), and ``pipe`` (both
directions, counting bytes and round trips). ``dialer.py`` is the head's end.

RPC is latency bound (one small message per round trip per token), so every socket gets
``TCP_NODELAY`` and the pipe writes each read straight through.

A gate given a ``GuardPolicy`` (``roles.py`` always gives one: the share the queen granted)
validates every RPC message both ways (``rpc_guard.RpcGuard``, one per connection, sharing the
member's ``MemberFacts``): the head's commands before they reach the server, the server's
replies to learn buffers and bases. A refused command ends the connection; ``on_refused`` hears
of it when the head broke the protocol (the member then reports it to the queen).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl as ssl_module
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from desktop_worker.errors import GroupLinkError, RpcRefused
from desktop_worker.groups import handshake
from desktop_worker.groups.handshake import Challenge, LineBuffer, LineTooLong, Verdict
from desktop_worker.groups.rpc_guard import GuardPolicy, MemberFacts, RpcGuard

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
CHUNK = 256 * 1024


class ByteReader(Protocol):
    async def read(self, n: int = -1) -> bytes: ...


class ByteWriter(Protocol):
    def write(self, data: bytes | memoryview) -> None: ...

    async def drain(self) -> None: ...

    def close(self) -> None: ...

    async def wait_closed(self) -> None: ...


# --- counting ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkStats:
    """What went over a gate's or a dialer's connections, live and closed together.

    A round trip is a head-to-member burst followed by a member-to-head burst, so the bench can
    report bytes and round trips per token on each link."""

    connections: int = 0
    bytes_to_member: int = 0
    bytes_to_head: int = 0
    round_trips: int = 0


class LinkCounters:
    """One piped connection's counters, kept by ``pipe``."""

    def __init__(self) -> None:
        self.bytes_to_member = 0
        self.bytes_to_head = 0
        self.round_trips = 0
        self._last_to_member = False

    def record(self, *, to_member: bool, n: int) -> None:
        if to_member:
            self.bytes_to_member += n
            self._last_to_member = True
            return
        self.bytes_to_head += n
        if self._last_to_member:
            self.round_trips += 1
        self._last_to_member = False


class StatsBook:
    """The counters of every connection a gate or dialer piped: live ones are summed on
    demand, closed ones folded into totals so nothing grows with the number of connections."""

    def __init__(self) -> None:
        self._live: set[LinkCounters] = set()
        self._closed = LinkStats()

    def open(self) -> LinkCounters:
        counters = LinkCounters()
        self._live.add(counters)
        return counters

    def close(self, counters: LinkCounters) -> None:
        if counters in self._live:
            self._live.discard(counters)
            self._closed = _add(self._closed, counters)

    def snapshot(self) -> LinkStats:
        total = self._closed
        for counters in self._live:
            total = _add(total, counters)
        return total


def _add(total: LinkStats, counters: LinkCounters) -> LinkStats:
    return LinkStats(
        connections=total.connections + 1,
        bytes_to_member=total.bytes_to_member + counters.bytes_to_member,
        bytes_to_head=total.bytes_to_head + counters.bytes_to_head,
        round_trips=total.round_trips + counters.round_trips,
    )


# --- reusable stream pieces -------------------------------------------------------------------


class _Closed(Exception):
    """The other side closed before a handshake line was whole."""


async def _read_line(reader: ByteReader, buffer: LineBuffer) -> bytes:
    """One bounded line; bytes after it stay in ``buffer.rest``."""
    pending, buffer.rest = buffer.rest, b""
    if pending and (line := buffer.feed(pending)) is not None:
        return line
    while True:
        data = await reader.read(buffer.read_size)
        if not data:
            raise _Closed
        if (line := buffer.feed(data)) is not None:
            return line


def set_nodelay(writer: object) -> None:
    """``TCP_NODELAY`` on the writer's socket, when it has a TCP one (not over a relay)."""
    get = getattr(writer, "get_extra_info", None)
    sock = get("socket") if get is not None else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


@dataclass(frozen=True)
class Admission:
    """The gate's side of one handshake: ``reason`` None means the head is in (no ``OK`` sent
    yet: the caller first dials the RPC port, then calls ``admit`` or ``refuse``). ``leftover``
    is what the head sent after its answer line, to be piped on first."""

    reason: str | None
    leftover: bytes = b""

    @property
    def ok(self) -> bool:
        return self.reason is None


async def authenticate_head(
    reader: ByteReader,
    writer: ByteWriter,
    *,
    group: str,
    head: str,
    token: bytes,
    timeout_s: float,
) -> Admission:
    """Challenges the peer and checks its answer. A refusal is sent (``NO <reason>``) before
    returning; ``closed`` means the peer left first (nothing to send)."""
    challenge = Challenge.new()
    buffer = LineBuffer()
    try:
        async with asyncio.timeout(timeout_s):
            writer.write(challenge.line())
            await writer.drain()
            line = await _read_line(reader, buffer)
    except TimeoutError:
        return await _refused(writer, "timeout")
    except LineTooLong:
        return await _refused(writer, "bad_line")
    except (_Closed, ConnectionError, ssl_module.SSLError):
        return Admission("closed")
    verdict = handshake.verify(token, group, head, challenge.nonce, line)
    if not verdict.ok:
        return await _refused(writer, verdict.reason or "bad_line")
    return Admission(None, buffer.rest)


async def admit(writer: ByteWriter) -> None:
    """Tells an authenticated head it is in; raw RPC bytes follow."""
    writer.write(Verdict().line())
    await writer.drain()


async def refuse(writer: ByteWriter, reason: str) -> None:
    """Sends ``NO <reason>`` if the peer still listens; the caller closes."""
    with contextlib.suppress(ConnectionError, ssl_module.SSLError, RuntimeError):
        writer.write(handshake.refusal_line(reason))
        await writer.drain()


async def _refused(writer: ByteWriter, reason: str) -> Admission:
    await refuse(writer, reason)
    return Admission(reason)


async def authenticate_member(
    reader: ByteReader,
    writer: ByteWriter,
    *,
    group: str,
    head: str,
    token: bytes,
    timeout_s: float,
) -> bytes:
    """The head's side: answers the gate's challenge and reads its verdict. Returns the bytes
    the gate sent after ``OK`` (normally none). Raises ``GroupLinkRefused`` on ``NO <reason>``
    and ``GroupLinkError`` on a timeout, a close or an unreadable line."""
    buffer = LineBuffer()
    try:
        async with asyncio.timeout(timeout_s):
            challenge = await _read_line(reader, buffer)
            writer.write(handshake.answer(token, group, head, challenge))
            await writer.drain()
            reply = await _read_line(reader, buffer)
    except TimeoutError:
        raise GroupLinkError(
            f"the member's gate did not finish the handshake within {timeout_s:g} s"
        ) from None
    except LineTooLong as exc:
        raise GroupLinkError("the member's gate sent an over-long handshake line") from exc
    except (_Closed, ConnectionError, ssl_module.SSLError) as exc:
        raise GroupLinkError(
            "the member's gate closed the connection during the handshake"
        ) from exc
    handshake.read_reply(reply)
    return buffer.rest


async def pipe(
    a_reader: ByteReader,
    a_writer: ByteWriter,
    b_reader: ByteReader,
    b_writer: ByteWriter,
    counters: LinkCounters,
    *,
    to_b_first: bytes = b"",
    to_a_first: bytes = b"",
    guard: RpcGuard | None = None,
) -> None:
    """Copies bytes both ways between side a (towards the head) and side b (towards the
    member) until either side closes or fails, then closes both. ``to_b_first`` and
    ``to_a_first`` are bytes already read past a handshake line, sent on before anything.
    With a ``guard`` only what it passes goes through (counted as sent), and its refusal
    (``RpcRefused``) ends both sides and is raised here."""

    async def copy(reader: ByteReader, writer: ByteWriter, to_member: bool, first: bytes) -> None:
        screen = None if guard is None else guard.from_head if to_member else guard.from_member
        data = first
        while True:
            if data:
                if screen is None:
                    counters.record(to_member=to_member, n=len(data))
                    writer.write(data)
                else:
                    chunks = screen(data)
                    sent = sum(len(chunk) for chunk in chunks)
                    if sent:
                        counters.record(to_member=to_member, n=sent)
                    for chunk in chunks:
                        writer.write(chunk)
                await writer.drain()
            data = await reader.read(CHUNK)
            if not data:
                return

    forward = asyncio.ensure_future(copy(a_reader, b_writer, True, to_b_first))
    backward = asyncio.ensure_future(copy(b_reader, a_writer, False, to_a_first))
    try:
        await asyncio.wait((forward, backward), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (forward, backward):
            task.cancel()
        await asyncio.gather(forward, backward, return_exceptions=True)
        await asyncio.gather(close_quietly(a_writer), close_quietly(b_writer))
    for task in (forward, backward):
        if task.done() and not task.cancelled():
            failure = task.exception()
            if isinstance(failure, RpcRefused):
                raise failure


async def close_quietly(writer: ByteWriter) -> None:
    with contextlib.suppress(Exception):
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), 1.0)


# --- the listeners ----------------------------------------------------------------------------


class PipeListener:
    """What the gate and the dialer share: a listener whose connections are tracked so that
    ``stop()`` closes them all, per-link counters, and the bound address."""

    def __init__(self) -> None:
        self._stats = StatsBook()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False

    def _bound(self, what: str) -> tuple[str, int]:
        if self._server is None or not self._server.sockets:
            raise RuntimeError(f"the {what} is not started")
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    def stats(self) -> LinkStats:
        return self._stats.snapshot()

    async def stop(self) -> None:
        """Closes the listener and every connection, piped or still in its handshake."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        set_nodelay(writer)
        await self._tracked(self._connection(reader, writer), writer)

    async def _tracked(self, work: Coroutine[Any, Any, None], writer: ByteWriter) -> None:
        """Runs one connection's ``work`` as a task ``stop()`` cancels, then closes ``writer``."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        try:
            if self._closing:
                work.close()
                return
            await work
        except asyncio.CancelledError:
            # ``stop()`` cancels this task; on Python 3.11 asyncio's stream callback calls
            # ``task.exception()`` on it, which would log a cancelled handler as an error.
            pass
        finally:
            self._tasks.discard(task)  # type: ignore[arg-type]
            await close_quietly(writer)

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


# --- the gate ---------------------------------------------------------------------------------


class MemberGate(PipeListener):
    """Listens for the group's head and pipes it to ``127.0.0.1:target_port``; or, never
    started (the relayed route), serves the channels handed to ``serve_stream``.

    ``host`` stays 127.0.0.1 unless the caller passes a LAN address (LAN mode); ``port`` 0
    takes an ephemeral port (see ``address``). ``ssl`` makes the listener TLS (the direct route
    over a LAN; ``tls.SelfSignedIdentity.server_context()``). Refusals are logged once at INFO
    and counted in ``refused`` by reason; at most ``max_pending`` handshakes run at once, more
    get ``NO busy``. ``guard``: validate the RPC bytes of every connection within this policy
    (None: pipe them as they are; only tests of the pipe itself, over a fake server, do);
    a refused RPC message is logged, counted in ``refused`` as ``rpc_<code>``, and, when the
    head sent it, passed to ``on_refused``.
    """

    def __init__(
        self,
        group: str,
        head: str,
        token: bytes,
        target_port: int,
        *,
        host: str = LOOPBACK,
        port: int = 0,
        ssl: ssl_module.SSLContext | None = None,
        handshake_timeout_s: float = 5.0,
        connect_timeout_s: float = 5.0,
        max_pending: int = 32,
        guard: GuardPolicy | None = None,
        on_refused: Callable[[RpcRefused], None] | None = None,
    ) -> None:
        super().__init__()
        self.group = handshake.check_name("group", group)
        self.head = handshake.check_name("head", head)
        self._token = handshake.check_token(token)
        self.target_port = target_port
        self._host = host
        self._port = port
        self._ssl = ssl
        self.handshake_timeout_s = handshake_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_pending = max_pending
        self.refused: Counter[str] = Counter()
        self._pending = 0
        self.guard = guard
        self.on_refused = on_refused
        self._facts = MemberFacts()  # what this member's server told any connection

    async def start(self) -> None:
        # A TLS handshake happens before ``_serve`` runs, so it gets the same deadline: a
        # client that never finishes it is dropped as fast as one that never answers.
        self._server = await asyncio.start_server(
            self._serve, self._host, self._port, ssl=self._ssl,
            ssl_handshake_timeout=self.handshake_timeout_s if self._ssl else None,
        )
        log.info("gate for group %s listening on %s:%d (%s), forwarding to %s:%d",
                 self.group, *self.address, "TLS" if self._ssl else "plain",
                 LOOPBACK, self.target_port)

    @property
    def address(self) -> tuple[str, int]:
        """The host and port the gate listens on (the ephemeral port once started)."""
        return self._bound("gate")

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        await self._handle(reader, writer, writer.get_extra_info("peername"))

    async def serve_stream(self, reader: ByteReader, writer: ByteWriter, peer: object) -> None:
        """Serves one connection that did not come through this gate's listener (a relayed
        channel: a relayed member's gate never listens): the same handshake, RPC dial and
        pipe, counted in ``stats()``, ended by ``stop()``; ``writer`` is closed at the end."""
        await self._tracked(self._handle(reader, writer, peer), writer)

    async def _handle(self, reader: ByteReader, writer: ByteWriter, peer: object) -> None:
        if self._pending >= self.max_pending:
            await refuse(writer, "busy")
            self._note_refusal(peer, "busy")
            return
        self._pending += 1
        try:
            admission = await authenticate_head(
                reader, writer, group=self.group, head=self.head, token=self._token,
                timeout_s=self.handshake_timeout_s,
            )
        finally:
            self._pending -= 1
        if not admission.ok:
            self._note_refusal(peer, admission.reason or "bad_line")
            return
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                rpc_reader, rpc_writer = await asyncio.open_connection(LOOPBACK, self.target_port)
        except (OSError, TimeoutError) as exc:
            log.warning("gate for group %s: the RPC server at %s:%d cannot be reached (%s)",
                        self.group, LOOPBACK, self.target_port, exc)
            await refuse(writer, "unavailable")
            self.refused["unavailable"] += 1
            return
        set_nodelay(rpc_writer)
        counters = self._stats.open()
        guard = RpcGuard(self.guard, self._facts) if self.guard is not None else None
        try:
            await admit(writer)
            log.debug("gate for group %s: head %s in from %s", self.group, self.head, peer)
            await pipe(reader, writer, rpc_reader, rpc_writer, counters,
                       to_b_first=admission.leftover, guard=guard)
        except RpcRefused as exc:
            self._rpc_refused(exc, peer)
        except (ConnectionError, ssl_module.SSLError):
            pass
        finally:
            await close_quietly(rpc_writer)
            self._stats.close(counters)
            log.debug("gate for group %s: connection from %s closed: %d bytes in, %d out, "
                      "%d round trips", self.group, peer, counters.bytes_to_member,
                      counters.bytes_to_head, counters.round_trips)

    def _rpc_refused(self, exc: RpcRefused, peer: object) -> None:
        self.refused[f"rpc_{exc.code}"] += 1
        if exc.by != "head":
            log.error("gate for group %s: this member's RPC server answered out of turn; "
                      "connection from %s ended: %s", self.group, peer, exc)
            return
        log.warning("gate for group %s refused the RPC command of head %s (from %s) and ended "
                    "its connection: %s", self.group, self.head, peer, exc)
        if self.on_refused is not None:
            self.on_refused(exc)

    def _note_refusal(self, peer: object, reason: str) -> None:
        self.refused[reason] += 1
        log.info("gate for group %s refused %s: %s", self.group, peer, reason)
