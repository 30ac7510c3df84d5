"""Relayed channels (issue 19, ``groups/relay.py``) with a fake send, then a relayed dialer and
a gate that never listens, joined by the in-test switchboard over the fake RPC server: bytes
go through unchanged and are counted, frames never pass ``MAX_RELAY_PAYLOAD``, a close reaches
the other end once, a full channel makes its feed wait, and a head with the wrong token never
reaches the RPC server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from desktop_worker.errors import GroupLinkError, GroupLinkRefused
from desktop_worker.groups.dialer import RelayedDialer
from desktop_worker.groups.gate import MemberGate, close_quietly
from desktop_worker.groups.relay import ChannelRefused, RelayTable
from desktop_worker.link.machine import RelayData
from shared_schema import GroupClose, GroupOpen
from shared_schema.groups import MAX_RELAY_CHANNEL, MAX_RELAY_PAYLOAD
from tests.desktop_worker.groups.gate_fakes import REPLY_PREFIX, FakeRpcServer, exchange, frame
from tests.desktop_worker.groups.relay_support import Switchboard

GROUP = "0123456789abcdef"
HEAD = "head-1"
MEMBER = "member-1"
TOKEN = b"t" * 32


class Sent:
    """A fake send: what a channel handed the link, in order."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    async def __call__(self, message: Any) -> None:
        self.items.append(message)

    def data(self) -> list[RelayData]:
        return [m for m in self.items if isinstance(m, RelayData)]

    def closes(self) -> list[GroupClose]:
        return [m for m in self.items if isinstance(m, GroupClose)]


async def settle() -> None:
    """Lets every ready task run (no time passes)."""
    for _ in range(20):
        await asyncio.sleep(0)


async def test_writes_go_out_in_frames_of_at_most_the_largest_payload() -> None:
    sent = Sent()
    channel = RelayTable().open(GROUP, 5, sent, side="head")
    data = bytes(range(256)) * (600 * 1024 // 256)  # more than two frames' worth
    channel.write(data[:1000])
    channel.write(data[1000:])
    await channel.drain()
    frames = sent.data()
    assert [len(f.payload) for f in frames] == [MAX_RELAY_PAYLOAD, MAX_RELAY_PAYLOAD,
                                                len(data) - 2 * MAX_RELAY_PAYLOAD]
    assert {f.channel for f in frames} == {5}
    assert b"".join(f.payload for f in frames) == data
    await channel.drain()  # nothing written since: nothing sent
    assert len(sent.data()) == 3


async def test_a_close_from_the_other_end_is_eof_after_the_buffer_and_is_not_answered() -> None:
    sent, table = Sent(), RelayTable()
    channel = table.open(GROUP, 5, sent, side="member")
    await table.deliver(5, b"hello ")
    await table.deliver(5, b"world")
    reading = asyncio.ensure_future(channel.read(100))
    assert await reading == b"hello world"
    waiting = asyncio.ensure_future(channel.read(100))
    await settle()
    assert not waiting.done()
    assert table.remote_close(GROUP, 5, "the head left")
    async with asyncio.timeout(5):
        assert await waiting == b""
    assert channel.close_reason == "the head left"
    assert table.get(5) is None
    channel.write(b"late")
    with pytest.raises(ConnectionResetError, match="the head left"):
        await channel.drain()
    await close_quietly(channel)
    assert sent.items == []  # the close came from the other end: nothing sent back
    assert not table.remote_close(GROUP, 5)  # a second close: not open any more


async def test_a_local_close_is_sent_once_and_ends_the_reader() -> None:
    sent, table = Sent(), RelayTable()
    channel = table.open(GROUP, 8, sent, side="head")
    waiting = asyncio.ensure_future(channel.read(10))
    channel.close("done")
    channel.close("again")
    await close_quietly(channel)
    async with asyncio.timeout(5):
        assert await waiting == b""
    assert sent.closes() == [GroupClose(group=GROUP, channel=8, reason="done")]
    assert len(table) == 0
    with pytest.raises(ConnectionResetError):
        channel.write(b"x")
    await table.deliver(8, b"crossing data")  # crosses the close: dropped
    assert channel.buffered == 0


async def test_a_full_channel_makes_its_feed_wait_until_the_reader_reads() -> None:
    sent, table = Sent(), RelayTable(high_water=1024)
    channel = table.open(GROUP, 3, sent, side="member")
    await table.deliver(3, b"a" * 1000)  # under the mark: returns at once
    feeding = asyncio.ensure_future(table.deliver(3, b"b" * 1000))
    await settle()
    assert not feeding.done()  # past the mark: the link's read loop would wait here
    assert channel.buffered == 2000  # bounded: the mark plus one frame
    assert await channel.read(1500) == b"a" * 1000 + b"b" * 500
    async with asyncio.timeout(5):
        await feeding
    assert await channel.read(-1) == b"b" * 500
    assert sent.items == []


async def test_a_reader_that_stays_behind_loses_its_channel() -> None:
    sent, table = Sent(), RelayTable(high_water=16, stall_s=0.05)
    channel = table.open(GROUP, 3, sent, side="member")
    async with asyncio.timeout(5):
        await table.deliver(3, b"x" * 64)  # nobody reads: the feed gives up, not the link
    assert channel.closed
    assert table.get(3) is None
    await close_quietly(channel)
    assert sent.closes() == [GroupClose(group=GROUP, channel=3, reason="stalled")]


async def test_unknown_channels_are_dropped_and_duplicates_refused() -> None:
    sent, table = Sent(), RelayTable(max_channels=2)
    await table.deliver(99, b"for nobody")  # dropped, no error
    assert not table.remote_close(GROUP, 99)
    table.open(GROUP, 1, sent, side="member")
    with pytest.raises(ChannelRefused, match="already open"):
        table.open(GROUP, 1, sent, side="member")
    table.open(GROUP, 2, sent, side="member")
    with pytest.raises(ChannelRefused, match="2 channels"):
        table.open(GROUP, 3, sent, side="member")
    assert not table.remote_close("f" * 16, 1)  # another group's close: not this channel
    assert table.get(1) is not None
    assert sent.items == []


async def test_a_head_numbers_channels_uniquely_and_wraps() -> None:
    sent, table = Sent(), RelayTable()
    first, second = table.open_next(GROUP, sent), table.open_next(GROUP, sent)
    assert (first.channel, second.channel) == (1, 2)
    first.silence()
    assert table.open_next(GROUP, sent).channel == 3  # a counter: 1 is not reused at once
    table._next = MAX_RELAY_CHANNEL
    assert table.open_next(GROUP, sent).channel == MAX_RELAY_CHANNEL
    assert table.open_next(GROUP, sent).channel == 1  # wrapped; 2 and 3 are still open
    assert table.open_next(GROUP, sent).channel == 4


async def test_dropping_ends_every_channel_and_sends_nothing() -> None:
    sent, table = Sent(), RelayTable()
    channels = [table.open(GROUP, n, sent, side="member") for n in (1, 2)]
    other = table.open("f" * 16, 3, sent, side="member")
    reads = [asyncio.ensure_future(c.read(10)) for c in channels]
    table.drop(GROUP)
    async with asyncio.timeout(5):
        assert await asyncio.gather(*reads) == [b"", b""]
    assert [table.get(n) for n in (1, 2)] == [None, None]
    assert table.get(3) is other
    table.drop()
    assert len(table) == 0
    await asyncio.gather(*(close_quietly(c) for c in (*channels, other)))
    assert sent.items == []


# --- a relayed dialer and a gate that never listens, over the switchboard ---------------------


class Wired:
    """A head's table and ``RelayedDialer``, a member's table and never-started gate."""

    def __init__(self, rpc: FakeRpcServer, *, token: bytes = TOKEN) -> None:
        self.board = Switchboard()
        self.head_table, self.member_table = RelayTable(), RelayTable()
        self.gate = MemberGate(GROUP, HEAD, TOKEN, rpc.port, handshake_timeout_s=2.0)
        self.dialer = RelayedDialer(GROUP, HEAD, token, MEMBER, self.head_table,
                                    self.board.sender(HEAD), connect_timeout_s=2.0)
        self.tasks: set[asyncio.Task[None]] = set()
        self.board.attach(HEAD, self._head_command, self.head_table.deliver)
        self.board.attach(MEMBER, self._member_command, self.member_table.deliver)

    def _head_command(self, message: Any) -> None:
        assert isinstance(message, GroupClose)
        self.head_table.remote_close(message.group, message.channel, message.reason)

    def _member_command(self, message: Any) -> None:
        if isinstance(message, GroupClose):
            self.member_table.remote_close(message.group, message.channel, message.reason)
            return
        assert isinstance(message, GroupOpen)
        channel = self.member_table.open(message.group, message.channel,
                                         self.board.sender(MEMBER), side="member")
        task = asyncio.ensure_future(self.gate.serve_stream(channel, channel, "relay"))
        self.tasks.add(task)

    async def close(self) -> None:
        await self.dialer.stop()
        await self.gate.stop()
        await asyncio.gather(*self.tasks, return_exceptions=True)


@pytest.fixture
async def wired(rpc: FakeRpcServer) -> AsyncIterator[Wired]:
    made = Wired(rpc)
    await made.dialer.start()
    yield made
    await made.close()


async def test_bytes_go_through_the_relay_unchanged_and_are_counted(
        wired: Wired, rpc: FakeRpcServer) -> None:
    await wired.dialer.check()
    await rpc.wait_closed(1)  # the check's connection: in and out again
    host, port = wired.dialer.endpoint.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        for payload in (b"ping", b"x" * 300_000):  # the second is more than one frame
            assert await exchange(reader, writer, payload) == REPLY_PREFIX + payload
    finally:
        writer.close()
    await rpc.wait_closed(2)
    assert rpc.received.endswith(frame(b"ping") + frame(b"x" * 300_000))
    assert 0 < wired.board.largest <= MAX_RELAY_PAYLOAD
    assert wired.dialer.stats().round_trips >= 2
    assert wired.gate.stats().round_trips >= 2
    assert wired.gate.stats().bytes_to_member == wired.dialer.stats().bytes_to_member
    await wired.board.wait_until(lambda: not wired.head_table and not wired.member_table)
    senders = sorted({sender for sender, _ in wired.board.closes})
    assert senders in ([HEAD], [MEMBER], [HEAD, MEMBER])
    assert len(wired.board.closes) <= 2 * len(wired.board.opens)


async def test_a_wrong_token_is_refused_before_the_rpc_server(rpc: FakeRpcServer) -> None:
    wired = Wired(rpc, token=b"w" * 32)
    await wired.dialer.start()
    try:
        with pytest.raises(GroupLinkRefused, match="bad_mac"):
            await wired.dialer.check()
        assert wired.gate.refused["bad_mac"] == 1
        assert rpc.accepts == 0
        assert wired.gate.stats().connections == 0
    finally:
        await wired.close()


async def test_a_channel_the_member_closes_at_once_fails_the_check_with_its_reason(
        rpc: FakeRpcServer) -> None:
    wired = Wired(rpc)

    def refuse(message: Any) -> None:
        wired.head_table.remote_close(message.group, message.channel, "not a relayed member")

    wired.board.attach(MEMBER, refuse, wired.member_table.deliver)
    try:
        with pytest.raises(GroupLinkError, match="not a relayed member"):
            await wired.dialer.check()
        assert len(wired.head_table) == 0
        assert rpc.accepts == 0
    finally:
        await wired.close()


async def test_stopping_the_gate_closes_a_piped_channel_at_both_ends(
        wired: Wired, rpc: FakeRpcServer) -> None:
    host, port = wired.dialer.endpoint.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    assert await exchange(reader, writer, b"hi") == REPLY_PREFIX + b"hi"
    await wired.gate.stop()
    async with asyncio.timeout(5):
        assert await reader.read() == b""  # llama.cpp's connection at the head is closed
    writer.close()
    await rpc.wait_closed(1)
    assert [sender for sender, _ in wired.board.closes][:1] == [MEMBER]
    await wired.board.wait_until(lambda: not wired.head_table and not wired.member_table)
