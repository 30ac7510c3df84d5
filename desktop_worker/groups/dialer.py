"""The head's end of the path to one member's gate (issue 19).

llama.cpp's RPC client speaks raw TCP to ``host:port`` and knows nothing of tokens or TLS, so
the head gives it a local endpoint instead: the dialer listens on ``127.0.0.1:<ephemeral>``
(``endpoint``), and for each connection llama.cpp opens there it dials the member's gate (TLS
pinned to the fingerprint the queen handed over, on the direct route over a LAN), answers the
gate's challenge with the group's token, and then pipes bytes both ways. A refusal or failure
closes the local connection and is kept in ``last_error`` for the head to report; ``check()``
tries the whole path once before llama.cpp is pointed at it, because any RPC failure aborts
the process that holds the RPC client.

The transport is a hook (``_transport``): TCP, TLS pinned, for the direct route; a relayed
channel through the queen for ``RelayedDialer`` (``relay.py``), with the same handshake, pipe
and counters.
"""

from __future__ import annotations

import asyncio
import logging

from desktop_worker.errors import GroupLinkError, GroupLinkRefused
from desktop_worker.groups import handshake, tls
from desktop_worker.groups.gate import (
    LOOPBACK,
    ByteReader,
    ByteWriter,
    PipeListener,
    authenticate_member,
    close_quietly,
    pipe,
    set_nodelay,
)
from desktop_worker.groups.relay import ChannelRefused, RelayChannel, RelaySend, RelayTable
from shared_schema.groups import GroupOpen

log = logging.getLogger(__name__)


class HeadDialer(PipeListener):
    """A local endpoint for llama.cpp that leads, authenticated, to one member's gate."""

    def __init__(
        self,
        group: str,
        head: str,
        token: bytes,
        member_host: str | None,
        member_port: int | None,
        *,
        tls_fingerprint: str | None = None,
        connect_timeout_s: float = 5.0,
    ) -> None:
        super().__init__()
        self.group = handshake.check_name("group", group)
        self.head = handshake.check_name("head", head)
        self._token = handshake.check_token(token)
        self.member_host = member_host
        self.member_port = member_port
        self._fingerprint = (
            tls.normalize_fingerprint(tls_fingerprint) if tls_fingerprint is not None else None
        )
        self.connect_timeout_s = connect_timeout_s
        self.last_error: str | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, LOOPBACK, 0)
        log.info("dialer for group %s: %s leads to %s (%s)", self.group, self.endpoint,
                 self.target, "TLS pinned" if self._fingerprint else "plain")

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:<port>``, the RPC endpoint to give llama.cpp for this member."""
        host, port = self._bound("dialer")
        return f"{host}:{port}"

    @property
    def target(self) -> str:
        """Where this dialer leads, for logs and failure messages."""
        return f"{self.member_host}:{self.member_port}"

    async def check(self) -> None:
        """Dials the gate and authenticates once, then hangs up; ``GroupLinkError`` (or its
        ``GroupLinkRefused`` and ``TlsPinMismatch``) says why the path does not work."""
        _reader, writer, _leftover = await self._dial()
        await close_quietly(writer)

    async def _dial(self) -> tuple[ByteReader, ByteWriter, bytes]:
        """A connection to the gate, past the transport's own checks and the handshake."""
        reader, writer = await self._transport()
        return reader, writer, await self._handshake(reader, writer)

    async def _handshake(self, reader: ByteReader, writer: ByteWriter) -> bytes:
        """The head's side of the handshake; the stream is closed when it fails."""
        try:
            return await authenticate_member(
                reader, writer, group=self.group, head=self.head, token=self._token,
                timeout_s=self.connect_timeout_s,
            )
        except BaseException:
            await close_quietly(writer)
            raise

    async def _transport(self) -> tuple[ByteReader, ByteWriter]:
        """A byte stream to the member's gate, before the handshake: TCP, with TLS pinned to
        the fingerprint when one was given (the direct route). ``RelayedDialer`` overrides it."""
        context = tls.client_context() if self._fingerprint is not None else None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(
                    self.member_host, self.member_port, ssl=context
                )
        except TimeoutError:
            raise GroupLinkError(
                f"the member's gate at {self.target} did not answer within "
                f"{self.connect_timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise GroupLinkError(
                f"the member's gate at {self.target} cannot be reached: {exc}"
            ) from exc
        try:
            set_nodelay(writer)
            if self._fingerprint is not None:
                tls.check_pin(writer.get_extra_info("ssl_object"), self._fingerprint)
        except BaseException:
            await close_quietly(writer)
            raise
        return reader, writer

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        try:
            member_reader, member_writer, leftover = await self._dial()
        except (GroupLinkError, OSError) as exc:
            self.last_error = str(exc)
            log.warning("dialer for group %s: %s", self.group, exc)
            return
        counters = self._stats.open()
        try:
            await pipe(reader, writer, member_reader, member_writer, counters,
                       to_a_first=leftover)
        finally:
            self._stats.close(counters)
            await close_quietly(member_writer)


class RelayedDialer(HeadDialer):
    """A local endpoint for llama.cpp that leads to a member through the queen (the relayed
    route): each connection is a new channel in the worker's ``RelayTable``, opened with
    ``GroupOpen`` naming the member, then the same handshake and pipe as a direct one."""

    def __init__(
        self,
        group: str,
        head: str,
        token: bytes,
        member: str,
        relay: RelayTable,
        send: RelaySend,
        *,
        connect_timeout_s: float = 5.0,
    ) -> None:
        super().__init__(group, head, token, None, None, connect_timeout_s=connect_timeout_s)
        self.member = member
        self.relay = relay
        self._send = send

    @property
    def target(self) -> str:
        return "relayed through the queen"

    async def _transport(self) -> tuple[ByteReader, ByteWriter]:
        channel = await self._open()
        return channel, channel

    async def _open(self) -> RelayChannel:
        """A new channel, registered before its ``GroupOpen`` is sent."""
        try:
            channel = self.relay.open_next(self.group, self._send)
        except ChannelRefused as exc:
            raise GroupLinkError(f"no relayed channel to {self.member}: {exc}") from exc
        try:
            await self._send(GroupOpen(group=self.group, channel=channel.channel,
                                       member=self.member))
        except BaseException:
            await close_quietly(channel)
            raise
        return channel

    async def _dial(self) -> tuple[ByteReader, ByteWriter, bytes]:
        channel = await self._open()
        try:
            return channel, channel, await self._handshake(channel, channel)
        except GroupLinkRefused:
            raise
        except GroupLinkError as exc:
            if channel.close_reason:  # the member (or the queen) said why it closed
                raise GroupLinkError(f"{exc} ({channel.close_reason})") from exc
            raise
