"""The relayed route (issue 19) on the workers, without a queen: members' and a head's
``GroupRoles`` whose reports are cross-wired through the in-test switchboard, which forwards
``group_open``, ``group_close`` and data frames exactly as the queen will. Over the real
llama.cpp RPC backend and the real SmolLM2: a relayed member listens nowhere (its ready has no
address), the head answers what one process answers through relayed channels, counted at both
ends, and ``group_end`` leaves no process and no channel. Then what hostile frames get: the
wrong token is ``link_failed`` with the RPC server never reached; a ``group_open`` for another
group, from a head, to a direct member or on a channel already open is closed back; data for no
channel is dropped; a dropped session ends every channel."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import psutil
import pytest

from desktop_worker.groups.dialer import RelayedDialer
from desktop_worker.link.machine import RelayData
from shared_schema import (
    GroupClose,
    GroupEnd,
    GroupFailed,
    GroupLead,
    GroupLink,
    GroupMemberReady,
    GroupOpen,
    GroupReady,
)
from tests.desktop_worker.groups.relay_support import Switchboard
from tests.desktop_worker.groups.roles_support import (
    GROUP,
    HEAD,
    Side,
    children,
    serve_frame,
)
from tests.support.rpc import needs_rpc

log = logging.getLogger(__name__)

pytestmark = needs_rpc




def wire(board: Switchboard, worker: str, side: Side) -> None:
    """``side``'s relayed frames go to the switchboard, and it hands ``side`` what the queen
    would: commands to ``receive``, data to ``relay`` (awaited)."""
    side.reports.relay = board.sender(worker)
    board.attach(worker, lambda message: side.roles.receive(message, side.reports),
                 side.roles.relay)


def listening(pid: int | None = None) -> set[tuple[str, int]]:
    """The TCP addresses a process listens on (this one by default)."""
    process = psutil.Process(pid)
    return {(c.laddr.ip, c.laddr.port) for c in process.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


def relayed_lead(head: Side, tokens: list[str], layers: tuple[int, ...], *,
                 head_layers: int = 10) -> GroupLead:
    links = [GroupLink(worker_id=f"member-{i}", token=token, device_layers=[count])
             for i, (token, count) in enumerate(zip(tokens, layers, strict=True))]
    assert all(link.relayed for link in links)
    return GroupLead(group=GROUP, head=HEAD, model="smol", n_ctx=512,
                     sha256=head.store.get("smol").sha256, head_layers=[head_layers],
                     members=links)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("member_layers", [(20,), (10, 10)])
async def test_relayed_members_and_a_head_serve_like_one_process_and_end_clean(
        sides, one_process_text: str, member_layers: tuple[int, ...]) -> None:
    before = children()
    board = Switchboard()
    members = [sides(f"member{i}") for i in range(len(member_layers))]
    head = sides("head")
    for i, member in enumerate(members):
        wire(board, f"member-{i}", member)
    wire(board, HEAD, head)
    tokens = [f"{i + 1:02x}" * 32 for i in range(len(members))]
    listens = listening()
    for member, token in zip(members, tokens, strict=True):
        member.send(serve_frame(token=token, route="relayed"))
    readies = [await member.reports.next() for member in members]
    assert readies == [GroupMemberReady(group=GROUP)] * len(members)  # no address at all
    assert all(ready.relayed for ready in readies)
    assert listening() == listens  # no gate listens, on loopback or anywhere
    for member in members:
        part = member.roles.part
        assert part.relayed
        assert listening(part.server.pid) == {("127.0.0.1", part.server.port)}  # RPC only

    started = time.monotonic()
    head.send(relayed_lead(head, tokens, member_layers))
    answer = await head.reports.next()
    lead_s = time.monotonic() - started
    assert isinstance(answer, GroupReady), answer
    log.info("%d relayed member(s): GroupLead -> GroupReady %.2f s (load_s %.2f); %d data "
             "frames, largest %d bytes", len(members), lead_s, answer.load_s, board.frames,
             board.largest)

    assert await head.chat() == one_process_text
    dialers = head.roles.part.dialers
    assert all(isinstance(dialer, RelayedDialer) for dialer in dialers)
    assert [d.member for d in dialers] == [f"member-{i}" for i in range(len(members))]
    for dialer in dialers:
        assert dialer.stats().round_trips > 0
    for member in members:
        assert member.roles.part.gate.stats().round_trips > 0
    assert board.opens
    assert all(sender == HEAD for sender, _ in board.opens)
    assert {o.channel for _, o in board.opens} == set(range(1, len(board.opens) + 1))
    assert len(head.roles.channels) == len(members)  # llama.cpp's one connection per member

    parts = [side.roles.part for side in (head, *members)]
    for side in (head, *members):
        side.send(GroupEnd(group=GROUP, reason="done"))
    async with asyncio.timeout(60):
        for part in parts:
            await part.down.wait()
    assert children() <= before
    for side in (head, *members):
        assert len(side.roles.channels) == 0
        assert side.roles.part is None
    assert head.reports.sent == [answer]
    assert [member.reports.sent for member in members] == [[ready] for ready in readies]


class Recorder:
    """A member's relayed frames, recorded instead of relayed (a queen that forwards none)."""

    def __init__(self) -> None:
        self.frames: list[Any] = []
        self.changed = asyncio.Condition()

    async def __call__(self, message: Any) -> None:
        async with self.changed:
            self.frames.append(message)
            self.changed.notify_all()

    async def close_for(self, channel: int) -> GroupClose:
        def found() -> GroupClose | None:
            return next((f for f in self.frames if isinstance(f, GroupClose)
                         and f.channel == channel), None)

        async with asyncio.timeout(10), self.changed:
            await self.changed.wait_for(lambda: found() is not None)
        close = found()
        assert close is not None
        return close

    async def data_on(self, channel: int) -> None:
        async with asyncio.timeout(10), self.changed:
            await self.changed.wait_for(lambda: any(
                isinstance(f, RelayData) and f.channel == channel for f in self.frames))


@pytest.mark.timeout(120)
async def test_a_relayed_head_with_the_wrong_token_is_link_failed_and_reaches_no_server(
        sides) -> None:
    board = Switchboard()
    member, head = sides("member"), sides("head")
    wire(board, "member-0", member)
    wire(board, HEAD, head)
    member.send(serve_frame(route="relayed"))
    assert await member.reports.next() == GroupMemberReady(group=GROUP)
    gate = member.roles.part.gate
    head.send(relayed_lead(head, ["77" * 32], (20,)))
    failed = await head.reports.next()
    assert isinstance(failed, GroupFailed)
    assert (failed.code, failed.group) == ("link_failed", GROUP)
    assert "member-0" in failed.message
    assert "bad_mac" in failed.message
    assert gate.refused["bad_mac"] == 1
    assert gate.stats().connections == 0  # no byte ever reached the RPC server
    async with asyncio.timeout(30):
        await head.roles.close()
    await board.wait_until(lambda: not member.roles.channels and not head.roles.channels)
    assert member.roles.part is not None  # the member is unharmed
    assert member.roles.part.ready


@pytest.mark.timeout(120)
async def test_hostile_opens_are_closed_back_and_a_dropped_session_ends_every_channel(
        sides) -> None:
    before = children()
    member = sides("member")
    frames = Recorder()
    member.reports.relay = frames
    member.send(serve_frame(route="relayed"))
    assert await member.reports.next() == GroupMemberReady(group=GROUP)
    part = member.roles.part
    other = "f" * 16

    member.roles.receive(GroupOpen(group=other, channel=1, member="member-0"), member.reports)
    assert "not in group" in (await frames.close_for(1)).reason
    # a channel the queen opens gets the gate's challenge
    member.roles.receive(GroupOpen(group=GROUP, channel=5, member="member-0"), member.reports)
    await frames.data_on(5)
    assert len(member.roles.channels) == 1
    # the same number again: closed back, and the open one ends with it
    member.roles.receive(GroupOpen(group=GROUP, channel=5, member="member-0"), member.reports)
    assert "already open" in (await frames.close_for(5)).reason
    assert len(member.roles.channels) == 0
    # data for no open channel: dropped, nothing answered
    count = len(frames.frames)
    await member.roles.relay(77, b"\x00" * 100)
    await member.roles.relay(5, b"crossed its close")
    assert len(frames.frames) == count

    member.roles.receive(GroupOpen(group=GROUP, channel=6, member="member-0"), member.reports)
    member.roles.receive(GroupOpen(group=GROUP, channel=7, member="member-0"), member.reports)
    await frames.data_on(7)
    assert len(member.roles.channels) == 2
    count = len(frames.frames)
    member.roles.session_ended()
    assert len(member.roles.channels) == 0  # at once, before the part is torn down
    async with asyncio.timeout(30):
        await part.down.wait()
    assert frames.frames[count:] == []  # nothing sent on a session that is gone
    assert part.gate.stats().connections == 0
    assert children() <= before


@pytest.mark.timeout(120)
async def test_opens_to_a_head_a_direct_member_or_no_group_are_closed_back(sides) -> None:
    direct, head = sides("direct"), sides("head")
    for side in (direct, head):
        side.reports.relay = Recorder()
    opening = GroupOpen(group=GROUP, channel=3, member="member-0")
    head.roles.receive(opening, head.reports)  # no part at all
    assert "not in group" in (await head.reports.relay.close_for(3)).reason
    direct.send(serve_frame())  # the direct route: a TLS gate, no channels
    assert (await direct.reports.next()).host == "127.0.0.1"
    direct.roles.receive(opening, direct.reports)
    assert "not a relayed member" in (await direct.reports.relay.close_for(3)).reason
    assert len(direct.roles.channels) == 0
