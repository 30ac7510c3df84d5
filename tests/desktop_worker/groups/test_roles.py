"""Two workers' ``GroupRoles`` driven by the queen's frames, without a queen, over the real
llama.cpp RPC backend and the real SmolLM2 on 127.0.0.1: a member reports its gate, a head
given a lead built from that report loads across it and answers what one process answers,
through the member's gate; ``group_end`` leaves no process or listener behind. Then what a
hostile or broken group gets: ``link_failed`` for a wrong fingerprint or token (the member's RPC
server never reached), ``model_missing``, ``bad_plan``, ``busy``, an end for another group
ignored, ``lost`` when a member is gone and ``server_failed`` when its server dies for good."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest

from desktop_worker.errors import EngineError
from desktop_worker.groups import roles as roles_module
from desktop_worker.groups.lan import local_address
from desktop_worker.groups.member import free_port
from shared_schema import (
    GroupEnd,
    GroupFailed,
    GroupLead,
    GroupLink,
    GroupMemberReady,
    GroupReady,
)
from tests.desktop_worker.groups.roles_support import (
    GROUP,
    HEAD,
    Side,
    children,
    lead_frame,
    refused,
    serve_frame,
)
from tests.support.rpc import needs_rpc

log = logging.getLogger(__name__)

pytestmark = needs_rpc




async def member_ready(member: Side) -> GroupMemberReady:
    member.send(serve_frame())
    ready = await member.reports.next()
    assert isinstance(ready, GroupMemberReady), ready
    return ready


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("head_layers", "member_layers"), [(10, (20,)), (10, (10, 10))])
async def test_members_and_a_head_serve_like_one_process_and_end_clean(
        sides, one_process_text: str, head_layers: int, member_layers: tuple[int, ...]) -> None:
    before = children()
    members = [sides(f"member{i}") for i in range(len(member_layers))]
    head = sides("head")
    tokens = [f"{i + 1:02x}" * 32 for i in range(len(members))]
    started = time.monotonic()
    for member, token in zip(members, tokens, strict=True):
        member.send(serve_frame(token=token))
    readies = [await member.reports.next() for member in members]
    serve_s = time.monotonic() - started
    assert all(isinstance(ready, GroupMemberReady) for ready in readies), readies
    assert {ready.group for ready in readies} == {GROUP}
    gates = [member.roles.part.gate for member in members]
    for ready, gate in zip(readies, gates, strict=True):
        assert ready.host == "127.0.0.1"  # lan_groups off: nothing listens beyond loopback
        assert gate.address == ("127.0.0.1", ready.port)

    links = [GroupLink(worker_id=f"member-{i}", host=ready.host, port=ready.port,
                       fingerprint=ready.fingerprint, token=token, device_layers=[layers])
             for i, (ready, token, layers) in enumerate(zip(readies, tokens, member_layers,
                                                            strict=True))]
    started = time.monotonic()
    head.send(GroupLead(group=GROUP, head=HEAD, model="smol", n_ctx=512,
                        sha256=head.store.get("smol").sha256, head_layers=[head_layers],
                        members=links))
    answer = await head.reports.next()
    lead_s = time.monotonic() - started
    assert isinstance(answer, GroupReady), answer
    assert answer.group == GROUP
    assert 0 < answer.load_s <= lead_s
    log.info("%d member(s): GroupServe -> GroupMemberReady %.2f s; GroupLead -> GroupReady "
             "%.2f s (load_s %.2f)", len(members), serve_s, lead_s, answer.load_s)

    assert await head.chat() == one_process_text
    assert await head.chat() == one_process_text  # the same head again, not a new one
    binding = head.roles.part.binding
    assert len(binding.heads) == 1
    assert binding.config.endpoints == tuple(d.endpoint for d in head.roles.part.dialers)
    assert binding.config.device_layers == member_layers
    assert binding.config.cpu_layers == head_layers
    for gate in gates:  # the weights and every token went through each gate
        assert gate.stats().round_trips > 0
    assert head.pool.context_limit("smol") == 1
    with pytest.raises(EngineError, match="embeddings"):
        await head.pool.embed("smol", ["hello"])
    assert children() - before  # the members' servers and the head's process

    parts = [side.roles.part for side in (head, *members)]
    endpoints = [dialer.endpoint.split(":") for dialer in parts[0].dialers]
    for side in (head, *members):
        side.send(GroupEnd(group=GROUP, reason="done"))
    async with asyncio.timeout(60):
        for part in parts:
            await part.down.wait()
    assert children() <= before
    for ready in readies:
        assert await refused("127.0.0.1", ready.port)
    assert all(await asyncio.gather(*(refused(host, int(port)) for host, port in endpoints)))
    assert "smol" not in head.pool.loaded()
    for side in (head, *members):
        assert side.roles.part is None
    assert head.reports.sent == [answer]  # an end is not answered
    assert [member.reports.sent for member in members] == [[ready] for ready in readies]
    # the model is served alone again afterwards (no group binding is left)
    assert await head.chat() == one_process_text


@pytest.mark.timeout(120)
async def test_a_wrong_fingerprint_or_token_is_link_failed_and_reaches_no_server(sides) -> None:
    member, head = sides("member"), sides("head")
    ready = await member_ready(member)
    gate = member.roles.part.gate
    head.send(lead_frame(ready, fingerprint="00" * 32))
    failed = await head.reports.next()
    assert isinstance(failed, GroupFailed)
    assert (failed.code, failed.group) == ("link_failed", GROUP)
    assert "member-1" in failed.message
    assert "certificate" in failed.message
    async with asyncio.timeout(30):
        await head.roles.close()  # torn down: the next lead starts clean
    head.send(lead_frame(ready, token="77" * 32))
    failed = await head.reports.next()
    assert (failed.code, failed.group) == ("link_failed", GROUP)
    assert "bad_mac" in failed.message
    assert gate.refused["bad_mac"] == 1
    assert gate.stats().connections == 0  # no byte ever reached the RPC server
    assert head.roles.part is None
    assert "smol" not in head.pool.loaded()
    assert member.roles.part is not None  # the member is unharmed
    assert member.roles.part.ready


@pytest.mark.timeout(120)
async def test_a_head_refuses_what_it_cannot_serve(sides) -> None:
    head = sides("head")
    nobody = GroupMemberReady(group=GROUP, host="127.0.0.1", port=free_port(),
                              fingerprint="ab" * 32)
    cases = [
        (lead_frame(nobody, model="someone/else:Q4_0"), "model_missing"),
        (lead_frame(nobody, sha256="0" * 64), "model_missing"),  # another file by that name
        (lead_frame(nobody, head_layers=(5,)), "bad_plan"),  # 25 layers of 30
        (lead_frame(nobody, head_layers=(5, 5)), "bad_plan"),  # GPU counts on a RAM-only head
        (lead_frame(nobody, member_layers=(10, 10, 10), head_layers=(1,)), "bad_plan"),
        (lead_frame(nobody), "link_failed"),  # the plan is right; nothing listens there
    ]
    for lead, code in cases:
        head.send(lead)
        failed = await head.reports.next(30)
        assert (failed.type, failed.code) == ("group_failed", code), (lead, failed)
        async with asyncio.timeout(30):
            await head.roles.close()
    assert head.pool.loaded() == set()


@pytest.mark.timeout(120)
async def test_a_second_group_is_busy_and_another_groups_end_is_ignored(sides) -> None:
    member = sides("member")
    ready = await member_ready(member)
    other = "f" * 16
    member.send(serve_frame(group=other))
    busy = await member.reports.next()
    assert (busy.type, busy.group, busy.code) == ("group_failed", other, "busy")
    member.send(lead_frame(ready, group=other))
    busy = await member.reports.next()
    assert (busy.group, busy.code) == (other, "busy")
    member.send(GroupEnd(group=other))
    await member.roles.end(other, "a test")  # the same path, awaited: nothing happens
    part = member.roles.part
    assert part is not None
    assert part.group == GROUP
    assert not part.ended
    assert not await refused("127.0.0.1", ready.port)


@pytest.mark.timeout(180)
async def test_a_member_gone_makes_the_head_report_lost_on_its_next_job(sides) -> None:
    member, head = sides("member"), sides("head", relink_s=1.0)
    before = children()
    ready = await member_ready(member)
    head.send(lead_frame(ready))
    assert isinstance(await head.reports.next(), GroupReady)
    head_part, member_part = head.roles.part, member.roles.part
    member.send(GroupEnd(group=GROUP, reason="the member left"))
    async with asyncio.timeout(30):
        await member_part.down.wait()
    failures = 0
    for _ in range(3):  # the running head dies on its next RPC; the one after cannot be made
        try:
            await head.chat()
        except EngineError:
            failures += 1
        if head.reports.sent[-1].type == "group_failed":
            break
    lost = head.reports.sent[-1]
    assert (lost.type, lost.code, lost.group) == ("group_failed", "lost", GROUP)
    assert "gone" in lost.message
    assert failures >= 1
    async with asyncio.timeout(60):
        await head_part.down.wait()
    assert [r.code for r in head.reports.sent if r.type == "group_failed"] == ["lost"]
    assert children() <= before


@pytest.mark.timeout(120)
async def test_a_member_whose_server_dies_for_good_reports_server_failed(sides) -> None:
    member = sides("member")
    before = children()
    ready = await member_ready(member)
    part = member.roles.part
    part.server.max_restarts = 0
    os.kill(part.server.pid, signal.SIGKILL)
    failed = await member.reports.next(60)
    assert (failed.type, failed.code, failed.group) == ("group_failed", "server_failed", GROUP)
    async with asyncio.timeout(30):
        await part.down.wait()
    assert await refused("127.0.0.1", ready.port)
    assert children() <= before


@pytest.mark.timeout(120)
async def test_with_lan_groups_the_gate_listens_on_the_lan_address(sides, monkeypatch) -> None:
    queen = "10.1.2.3"
    address = local_address(queen)
    if address is None or address == "127.0.0.1":
        pytest.skip("this machine has no route off loopback")
    member = sides("member", lan_groups=True, queen_host=queen)
    ready = await member_ready(member)
    assert ready.host == address
    assert member.roles.part.gate.address == (address, ready.port)
    assert await refused("127.0.0.1", ready.port)  # not on loopback as well
    # an address towards the queen that is no LAN address: no gate at all
    monkeypatch.setattr(roles_module, "local_address", lambda host: "8.8.8.8")
    lone = sides("lone", lan_groups=True, queen_host=queen)
    lone.send(serve_frame())
    failed = await lone.reports.next(30)
    assert (failed.code, failed.group) == ("server_failed", GROUP)
    assert "not a LAN address" in failed.message


@pytest.mark.timeout(120)
async def test_a_pause_ends_the_part_as_paused_and_a_dropped_link_ends_it_silently(
        sides) -> None:
    before = children()
    member = sides("member")
    ready = await member_ready(member)
    part = member.roles.part
    member.roles.pause("on battery")
    failed = await member.reports.next(30)
    assert (failed.type, failed.code, failed.group) == ("group_failed", "paused", GROUP)
    assert "on battery" in failed.message
    async with asyncio.timeout(30):
        await part.down.wait()
    assert await refused("127.0.0.1", ready.port)

    ready = await member_ready(member)  # a new group once the last one is down
    part = member.roles.part
    member.roles.session_ended()
    async with asyncio.timeout(30):
        await part.down.wait()
    assert member.reports.sent[-1] == ready  # nothing sent: the session is gone
    assert await refused("127.0.0.1", ready.port)
    assert children() <= before


@pytest.mark.timeout(120)
async def test_an_end_during_setup_stops_what_was_started(sides) -> None:
    """The queen ends a group while the member is still starting its server: the child is
    stopped and nothing is reported."""
    before = children()
    member = sides("member")
    member.send(serve_frame())
    part = member.roles.part
    member.send(GroupEnd(group=GROUP, reason="changed its mind"))
    async with asyncio.timeout(30):
        await part.down.wait()
    assert member.reports.sent == []
    assert children() <= before
    assert member.roles.part is None


@pytest.mark.timeout(120)
async def test_the_next_group_sent_right_after_an_end_is_served_not_busy(sides) -> None:
    """The queen ends a group and forms the next at once (a member left mid-answer): the new
    command comes on the link right after the end, before this worker has torn the old part
    down. It is taken, and served once the old part is down, never refused as "busy"."""
    member = sides("member")
    await member_ready(member)
    old = member.roles.part
    assert old is not None
    nxt = "e" * 16
    member.send(GroupEnd(group=GROUP, reason="a member left"))  # the same tick as the next
    member.send(serve_frame(group=nxt))
    report = await member.reports.next()
    assert (report.type, report.group) == ("group_member_ready", nxt), report
    assert old.down.is_set()  # the old part's server was gone before the new one started
    assert member.roles.part is not None
    assert member.roles.part.group == nxt
