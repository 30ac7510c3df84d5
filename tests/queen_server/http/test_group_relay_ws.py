"""The relayed route over the queen's real ``/worker`` websocket (issue 19): signed workers on
127.0.0.1 connections, a relayed group put in the queen's ``GroupService`` by the test, and the
frames that cross: the head's ``group_open`` reaches its member, binary data frames go both
ways byte for byte, and hostile binary frames are refused or dropped without reaching anyone."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from queen_server.groups import GroupPlan, MemberPlan, Route
from queen_server.placement.groups import Group, Phase
from shared_schema import (
    SUBPROTOCOL,
    Challenge,
    GroupClose,
    GroupOpen,
    JobError,
    Welcome,
    decode,
    encode,
    queen_origin,
)
from shared_schema.groups import relay_frame
from tests.support.queen import QueenHarness, running_queen
from tests.support.workers import new_key, pubkey_hex, signed_hello

GROUP = "0123456789abcdef"
WAIT = 10.0


class RawWorker:
    """A signed worker whose every frame, text or binary, the test reads and writes."""

    def __init__(self, ws: ClientConnection, key: str) -> None:
        self.ws = ws
        self.key = key
        self.text: asyncio.Queue[object] = asyncio.Queue()
        self.binary: asyncio.Queue[bytes] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for frame in self.ws:
                if isinstance(frame, bytes):
                    self.binary.put_nowait(frame)
                else:
                    message = decode(frame)
                    if message.type not in ("ping", "demand"):
                        self.text.put_nowait(message)

    async def next_text(self) -> object:
        return await asyncio.wait_for(self.text.get(), WAIT)

    async def next_binary(self) -> bytes:
        return await asyncio.wait_for(self.binary.get(), WAIT)

    async def close(self) -> None:
        await self.ws.close()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


@contextlib.asynccontextmanager
async def raw_worker(queen: QueenHarness) -> AsyncIterator[RawWorker]:
    key = new_key()
    async with connect(queen.ws_url, subprotocols=[SUBPROTOCOL], proxy=None,
                       compression=None) as ws:
        challenge = decode(await ws.recv())
        assert isinstance(challenge, Challenge)
        await ws.send(encode(signed_hello(key, challenge.nonce, models=[],
                                          origin=queen_origin(queen.ws_url))))
        assert isinstance(decode(await ws.recv()), Welcome)
        worker = RawWorker(ws, pubkey_hex(key))
        await queen.wait_until(lambda: queen.state.registry.get(worker.key) is not None, WAIT,
                               "the worker registered")
        try:
            yield worker
        finally:
            await worker.close()


def put_group(queen: QueenHarness, head: RawWorker, member: RawWorker) -> Group:
    """A ready group whose head reaches ``member`` through the queen."""
    registry = queen.state.registry
    head_w, member_w = registry.get(head.key), registry.get(member.key)
    assert head_w is not None
    assert member_w is not None
    plans = (MemberPlan(head.key, 0, 4, (4,), 1, 1, 0, Route.LOCAL),
             MemberPlan(member.key, 4, 8, (4,), 1, 1, 0, Route.RELAYED))
    plan = GroupPlan(head.key, plans, "b", 512, 1, 2, 0.0, 0, 0.0)
    group = Group(id=GROUP, model="m", sha256="0" * 64, size_bytes=1, plan=plan, head=head_w,
                  members={member.key: member_w}, tokens={member.key: "c" * 64}, started=0.0,
                  phase=Phase.READY)
    queen.state.groups.groups[GROUP] = group
    return group


@pytest.fixture
async def queen(tmp_path) -> AsyncIterator[QueenHarness]:
    async with running_queen(tmp_path, groups=False, max_bad_frames=3) as made:
        yield made


async def test_a_relayed_channel_carries_bytes_both_ways_over_the_websockets(queen) -> None:
    async with raw_worker(queen) as head, raw_worker(queen) as member, \
            raw_worker(queen) as outsider:
        put_group(queen, head, member)
        member_id = queen.state.registry.get(member.key).public_id  # type: ignore[union-attr]
        opening = GroupOpen(group=GROUP, channel=11, member=member_id)
        await head.ws.send(encode(opening))
        assert await member.next_text() == opening
        big = bytes(range(256)) * 1024  # the largest payload a frame may carry
        for frame in (relay_frame(11, b"hello member"), relay_frame(11, big)):
            await head.ws.send(frame)
            assert await member.next_binary() == frame
        answer = relay_frame(11, b"hello head")
        await member.ws.send(answer)
        assert await head.next_binary() == answer
        # An outsider's frame on the same channel number goes nowhere; a malformed binary
        # frame is answered with a typed error and counted.
        await outsider.ws.send(relay_frame(11, b"let me in"))
        await outsider.ws.send(b"\x07not a relay frame")
        error = await outsider.next_text()
        assert isinstance(error, JobError)
        assert error.code == "bad_relay_frame"
        # The member closes the channel: the head is told, and its next frame is dropped.
        await member.ws.send(encode(GroupClose(group=GROUP, channel=11, reason="eof")))
        closed = await head.next_text()
        assert isinstance(closed, GroupClose)
        assert closed.channel == 11
        await head.ws.send(relay_frame(11, b"too late"))
        await queen.wait_until(lambda: queen.state.groups.relay.dropped >= 2, WAIT,
                               "the late frames dropped")
        assert member.binary.empty()
        usage = queen.state.groups.relay.usage(GROUP)
        assert usage.bytes_to_members == len(b"hello member") + len(big)
        assert usage.bytes_to_head == len(b"hello head")
