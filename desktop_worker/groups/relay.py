"""Relayed channels (issue 19): a head's connection to a member carried through the queen over
both workers' websockets, for workers that cannot reach each other directly.

A *channel* is one connection: the head opens it (``GroupOpen``, a number it picks), the queen
passes it to the member, and each binary frame (``relay_frame``: the channel and at most
``MAX_RELAY_PAYLOAD`` bytes) is forwarded unchanged to the other end until ``GroupClose`` from
either end or the queen. ``RelayChannel`` is that connection as the ``ByteReader`` and
``ByteWriter`` the gate's pieces take (``authenticate_head``, ``authenticate_member``,
``pipe``), so the relayed route runs the same handshake and pipe as the direct one.
``RelayTable`` holds one worker's open channels, by number.

Backpressure: the link awaits ``RelayTable.deliver`` for every data frame, and a channel's
``feed`` waits while more than ``high_water`` bytes wait for its reader, so a slow reader stops
the websocket's read loop and TCP pushes back through the queen to the sender. A reader stuck
longer than ``stall_s`` gets its channel closed (``stalled``) rather than holding the whole link
(the websocket's keepalive would drop it soon after). Sends go through the link's ``ws.send``,
which waits while the socket's buffer is full. Nothing here touches a socket: ``send`` is the
link's report callable, so the table is testable with a fake one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Literal

from desktop_worker.link.machine import RelayData
from shared_schema.groups import MAX_RELAY_CHANNEL, MAX_RELAY_PAYLOAD, GroupClose, GroupOpen

log = logging.getLogger(__name__)

HIGH_WATER = 4 * 1024 * 1024  # bytes waiting for a channel's reader before its feed waits
STALL_S = 10.0  # a reader that takes no bytes for this long loses its channel
MAX_CHANNELS = 16  # open at once on one worker (llama.cpp keeps one connection per server)

# Sends a relayed frame on the session the group belongs to: a ``GroupClose`` or a chunk of data
# (``GroupOpen`` too, from a head). A no-op once that session is gone.
RelaySend = Callable[[GroupOpen | GroupClose | RelayData], Awaitable[None]]


class ChannelRefused(Exception):
    """A channel cannot be opened: its number is in use, or too many are open."""


class RelayChannel:
    """One relayed connection, both ways: the bytes the other end sent (``read``, fed by the
    table) and the way to send it bytes (``write``/``drain``). ``close`` ends both ways and
    tells the other end once, unless the close came from it."""

    def __init__(self, table: RelayTable, group: str, channel: int, send: RelaySend, *,
                 side: Literal["head", "member"], high_water: int, stall_s: float) -> None:
        self.table = table
        self.group = group
        self.channel = channel
        self.side = side
        self._send = send
        self._high_water = high_water
        self._stall_s = stall_s
        self._inbox = bytearray()
        self._readable = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._outbox = bytearray()
        self._sending = asyncio.Lock()
        self._eof = False
        self.closed = False  # closed on this side (no more reading or writing)
        self.close_reason: str | None = None  # why the other end (or the queen) closed it
        self._close_task: asyncio.Task[None] | None = None

    @property
    def buffered(self) -> int:
        """Bytes received and not yet read."""
        return len(self._inbox)

    # --- the reading side (ByteReader) ------------------------------------------------------

    async def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (every buffered byte when ``n`` < 0), waiting for at least one;
        ``b""`` once the channel is closed and its buffer read."""
        while not self._inbox:
            if self._eof or self.closed:
                return b""
            self._readable.clear()
            await self._readable.wait()
        size = len(self._inbox) if n < 0 else min(n, len(self._inbox))
        data = bytes(self._inbox[:size])
        del self._inbox[:size]
        if len(self._inbox) < self._high_water:
            self._room.set()
        return data

    async def feed(self, payload: bytes) -> None:
        """Bytes from the other end; waits while the reader is ``high_water`` behind, and
        closes the channel (``stalled``) when it stays behind for ``stall_s``."""
        if self._eof or self.closed:
            return
        self._inbox += payload
        self._readable.set()
        if len(self._inbox) < self._high_water:
            return
        self._room.clear()
        try:
            async with asyncio.timeout(self._stall_s):
                await self._room.wait()
        except TimeoutError:
            log.warning("relay channel %d of group %s: its reader took nothing for %g s with "
                        "%d bytes waiting; closed", self.channel, self.group, self._stall_s,
                        len(self._inbox))
            self.close("stalled")

    def feed_eof(self, reason: str = "") -> None:
        """The other end (or the queen) closed the channel: the reader gets what is buffered,
        then EOF; writes fail; nothing is sent back."""
        self._eof = True
        self.close_reason = reason
        self._readable.set()
        self._room.set()

    # --- the writing side (ByteWriter) ------------------------------------------------------

    def write(self, data: bytes | memoryview) -> None:
        if self.closed:
            raise ConnectionResetError(f"relay channel {self.channel} is closed")
        self._outbox += data

    async def drain(self) -> None:
        """Sends what was written, in frames of at most ``MAX_RELAY_PAYLOAD`` bytes, each
        awaited (the link's send waits while the websocket's buffer is full)."""
        async with self._sending:
            while self._outbox:
                if self.closed or self._eof:
                    self._outbox.clear()
                    raise ConnectionResetError(
                        f"relay channel {self.channel} was closed"
                        + (f": {self.close_reason}" if self.close_reason else ""))
                chunk = bytes(self._outbox[:MAX_RELAY_PAYLOAD])
                del self._outbox[:MAX_RELAY_PAYLOAD]
                await self._send(RelayData(self.channel, chunk))

    def close(self, reason: str = "") -> None:
        """Ends the channel on this side: the reader gets EOF, the table forgets it, and the
        other end is sent ``GroupClose`` once (not when the close came from it)."""
        if self.closed:
            return
        self.closed = True
        self._outbox.clear()
        self._readable.set()
        self._room.set()
        self.table.forget(self)
        if not self._eof:
            self._close_task = asyncio.get_running_loop().create_task(self._say_closed(reason))

    def silence(self) -> None:
        """Ends the channel with nothing sent (the session it ran over is gone)."""
        self._eof = True
        self.close()

    async def _say_closed(self, reason: str) -> None:
        try:
            await self._send(GroupClose(group=self.group, channel=self.channel,
                                        reason=reason[:200]))
        except Exception:  # the link's failure is the link's; the channel is closed anyway
            log.debug("relay channel %d: could not send its close", self.channel, exc_info=True)

    async def wait_closed(self) -> None:
        task = self._close_task
        if task is not None:
            await asyncio.shield(task)

    def get_extra_info(self, name: str, default: object = None) -> object:
        """Like a stream writer's: a channel has no socket (no ``TCP_NODELAY`` to set)."""
        return {"peername": f"relay channel {self.channel}"}.get(name, default)


class RelayTable:
    """One worker's open relayed channels, by number (a head's, which it numbers, or a
    member's, numbered by its head)."""

    def __init__(self, *, high_water: int = HIGH_WATER, stall_s: float = STALL_S,
                 max_channels: int = MAX_CHANNELS) -> None:
        self.high_water = high_water
        self.stall_s = stall_s
        self.max_channels = max_channels
        self._channels: dict[int, RelayChannel] = {}
        self._next = 1

    def __len__(self) -> int:
        return len(self._channels)

    def get(self, channel: int) -> RelayChannel | None:
        return self._channels.get(channel)

    def open(self, group: str, channel: int, send: RelaySend, *,
             side: Literal["head", "member"]) -> RelayChannel:
        """Registers channel ``channel`` (synchronously: data that follows its open finds it);
        ``ChannelRefused`` when the number is open or the table is full."""
        if channel in self._channels:
            raise ChannelRefused(f"channel {channel} is already open")
        if len(self._channels) >= self.max_channels:
            raise ChannelRefused(f"{self.max_channels} channels are open already")
        made = RelayChannel(self, group, channel, send, side=side,
                            high_water=self.high_water, stall_s=self.stall_s)
        self._channels[channel] = made
        return made

    def open_next(self, group: str, send: RelaySend) -> RelayChannel:
        """A head's new channel, numbered by a counter (never a number still open)."""
        for _ in range(self.max_channels + 1):
            channel = self._next
            self._next = channel + 1 if channel < MAX_RELAY_CHANNEL else 1
            if channel not in self._channels:
                return self.open(group, channel, send, side="head")
        raise ChannelRefused(f"{self.max_channels} channels are open already")

    def forget(self, channel: RelayChannel) -> None:
        if self._channels.get(channel.channel) is channel:
            del self._channels[channel.channel]

    async def deliver(self, channel: int, payload: bytes) -> None:
        """A data frame from the queen: fed to its channel (waiting while that channel's
        reader is behind); for a channel not open here (a close may cross it), dropped."""
        found = self._channels.get(channel)
        if found is None:
            log.debug("relayed data for channel %d, which is not open here; dropped", channel)
            return
        await found.feed(payload)

    def remote_close(self, group: str, channel: int, reason: str = "") -> bool:
        """``GroupClose`` from the queen: the channel's reader sees EOF. False when no such
        channel of ``group`` is open (it crossed our own close)."""
        found = self._channels.get(channel)
        if found is None or found.group != group:
            log.debug("a close for channel %d of group %s, not open here; ignored", channel,
                      group)
            return False
        del self._channels[channel]
        found.feed_eof(reason)
        return True

    def drop(self, group: str | None = None) -> None:
        """Ends ``group``'s channels (every channel when None) with nothing sent: its part
        is over, or the session they ran over is gone."""
        for found in list(self._channels.values()):
            if group is None or found.group == group:
                found.silence()
