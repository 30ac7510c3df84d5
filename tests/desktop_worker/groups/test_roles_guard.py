"""A member's roles with its validating gate (issue 34): the share comes from the queen (or,
from an older queen, the worker's own memory), and a head whose RPC command the gate refuses
ends the member's part with ``head_protocol``, the report on which the queen blames the head."""

from __future__ import annotations

import asyncio

import pytest

from desktop_worker.groups import tls
from desktop_worker.groups.gate import authenticate_member
from shared_schema import GroupFailed, GroupMemberReady, GroupServe
from tests.desktop_worker.groups.roles_support import GROUP, HEAD, TOKEN, children, refused
from tests.desktop_worker.groups.rpc_script import ScriptedHead, alloc
from tests.support.rpc import needs_rpc

pytestmark = needs_rpc

MB = 1024 * 1024


def serve(share_mb: list[int] | None) -> GroupServe:
    return GroupServe(group=GROUP, head=HEAD, token=TOKEN, layers=20, model="smol",
                      share_mb=share_mb)


async def scripted_head(ready: GroupMemberReady) -> ScriptedHead:
    """A head that is no llama.cpp, past the member's TLS (pinned) and its handshake."""
    assert ready.host is not None
    assert ready.fingerprint is not None
    reader, writer = await asyncio.open_connection(ready.host, ready.port,
                                                   ssl=tls.client_context())
    tls.check_pin(writer.get_extra_info("ssl_object"), ready.fingerprint)
    await authenticate_member(reader, writer, group=GROUP, head=HEAD,
                              token=bytes.fromhex(TOKEN), timeout_s=5.0)
    return ScriptedHead(reader, writer)


@pytest.mark.timeout(120)
async def test_a_head_past_its_share_ends_the_members_part_as_head_protocol(sides) -> None:
    before = children()
    member = sides("member")
    member.send(serve([64]))
    ready = await member.reports.next()
    assert isinstance(ready, GroupMemberReady), ready
    part = member.roles.part
    assert part.gate.guard.share_bytes == (64 * MB,)
    head = await scripted_head(ready)
    try:
        assert await head.hello() == (7, 0, 0)
        await head.buffer(60 * MB)  # within the share: served
        await head.send(alloc(8 * MB))  # 68 MB in all: past it
        failed = await member.reports.next()
        assert await head.closed()
    finally:
        await head.close()
    assert isinstance(failed, GroupFailed), failed
    assert failed.group == GROUP
    assert failed.code == "head_protocol"
    assert "ALLOC_BUFFER" in failed.message
    assert "over_share" in failed.message
    async with asyncio.timeout(30):
        await part.down.wait()  # the part ended: its server and gate are gone
    assert member.roles.part is None
    assert await refused(ready.host, ready.port)
    assert children() <= before


@pytest.mark.timeout(120)
async def test_from_a_queen_that_sends_no_share_the_head_gets_the_members_own_memory(
        sides) -> None:
    told = sides("told", memory_mb=lambda: [48])  # what it told the queen (device_free_mb)
    told.send(serve(None))
    assert isinstance(await told.reports.next(), GroupMemberReady)
    assert told.roles.part.gate.guard.share_bytes == (48 * MB,)
    untold = sides("untold")  # no device memory known: its pool's budget
    untold.send(serve(None))
    assert isinstance(await untold.reports.next(), GroupMemberReady)
    assert untold.roles.part.gate.guard.share_bytes == (untold.pool.budget_mb * MB,)
