"""The relayed route of model groups (issue 19): the queen as a switchboard between a head and
the members it cannot reach directly. ``GroupService`` and ``GroupRelay`` over a real registry,
workers on fake connections that record every frame; the head, the members and an outsider
are played by the test, honest and hostile."""

from __future__ import annotations

from queen_server.placement.groups import Phase
from shared_schema import (
    GroupClose,
    GroupEnd,
    GroupLead,
    GroupMemberReady,
    GroupOpen,
    GroupReady,
    GroupServe,
)
from shared_schema.groups import relay_frame
from tests.queen_server.placement.group_harness import FINGERPRINT, Groups, add_three, up
from tests.queen_server.placement.harness import MODEL

OTHER_HOUSE = "198.51.100.9"  # m2's public address: another LAN than the head's


async def relayed(groups: Groups) -> tuple[GroupServe, GroupLead]:
    """m2 lives on another LAN: the group forms with m1 direct and m2 relayed, and is ready.
    Returns m2's serve and the head's lead."""
    add_three(groups, host=OTHER_HOUSE)
    await groups.service.tick()
    s1 = await groups.frame("m1", GroupServe)
    s2 = await groups.frame("m2", GroupServe)
    assert (s1.route, s2.route) == ("direct", "relayed")  # type: ignore[attr-defined]
    groups.ready("m1", s1, 40_001)  # type: ignore[arg-type]
    groups.ready("m2", s2)  # type: ignore[arg-type]
    lead = await groups.frame("head", GroupLead)
    assert isinstance(lead, GroupLead)
    groups.service.on_report(groups.swarm.workers["head"],
                             GroupReady(group=lead.group, load_s=1.0))
    await up(groups.service.by_model[MODEL])
    return s2, lead  # type: ignore[return-value]


def binary(groups: Groups, name: str) -> list[bytes]:
    return groups.swarm.connections[name].binary


def closes(groups: Groups, name: str) -> list[GroupClose]:
    return groups.frames(name, GroupClose)


async def test_members_on_another_lan_are_reached_through_the_queen(groups: Groups) -> None:
    serve, lead = await relayed(groups)
    links = {m.worker_id: m for m in lead.members}
    assert links["m1"].host is not None
    assert not links["m1"].relayed
    assert links["m2"].relayed
    assert links["m2"].port is None
    assert links["m2"].fingerprint is None
    assert links["m2"].token == serve.token  # the member's gate checks the same token
    workers = groups.swarm.workers
    head, m1, m2 = workers["head"], workers["m1"], workers["m2"]
    service = groups.service

    # The head opens a channel to m2: m2 is told, nobody else.
    opening = GroupOpen(group=lead.group, channel=5, member="m2")
    await service.on_channel(head, opening)
    assert groups.frames("m2", GroupOpen) == [opening]
    assert not groups.frames("m1", GroupOpen)
    assert not closes(groups, "head")

    # Bytes go both ways unchanged, on the same channel number, and are counted.
    to_member, to_head = relay_frame(5, b"\x01" * 1000), relay_frame(5, b"answer")
    assert await service.relay.forward(head, 5, to_member)
    assert await service.relay.forward(m2, 5, to_head)
    assert binary(groups, "m2") == [to_member]
    assert binary(groups, "head") == [to_head]
    assert not binary(groups, "m1")
    [row] = service.rows()
    assert (row["relayed_channels"], row["relayed_bytes"]) == (1, 1000 + len(b"answer"))
    routes = {m["worker"]: m["route"] for m in row["members"]}  # type: ignore[attr-defined]
    assert routes == {"head": "local", "m1": "direct", "m2": "relayed"}

    # m2 closes it: the head is told; a frame crossing the close is dropped, not forwarded.
    await service.on_channel(m2, GroupClose(group=lead.group, channel=5, reason="eof"))
    assert [c.channel for c in closes(groups, "head")] == [5]
    assert not await service.relay.forward(head, 5, to_member)
    assert binary(groups, "m2") == [to_member]
    assert service.relay.dropped == 1
    [row] = service.rows()
    assert (row["relayed_channels"], row["relayed_bytes"]) == (0, 1000 + len(b"answer"))
    assert m1.held_by == m2.held_by == lead.group


async def test_only_the_head_opens_channels_and_only_to_its_relayed_members(
        groups: Groups) -> None:
    _, lead = await relayed(groups)
    workers = groups.swarm.workers
    head, m1, m2 = workers["head"], workers["m1"], workers["m2"]
    eve = groups.add("eve", 1, host=OTHER_HOUSE)
    service = groups.service
    attempts = [
        (m2, GroupOpen(group=lead.group, channel=1, member="m2"), "m2", "head"),
        (m1, GroupOpen(group=lead.group, channel=2, member="m2"), "m1", "head"),
        (eve, GroupOpen(group=lead.group, channel=3, member="m2"), "eve", "head"),
        (head, GroupOpen(group=lead.group, channel=4, member="m1"), "head", "directly"),
        (head, GroupOpen(group=lead.group, channel=5, member="eve"), "head", "not a member"),
        (head, GroupOpen(group="f" * 16, channel=6, member="m2"), "head", "not loading"),
    ]
    for sender, opening, told, why in attempts:
        await service.on_channel(sender, opening)
        [refusal] = [c for c in closes(groups, told) if c.channel == opening.channel]
        assert why in refusal.reason
    assert not groups.frames("m2", GroupOpen)
    assert not groups.frames("m1", GroupOpen)

    # A channel number is one channel; an outsider's frames on it go nowhere, and so do a
    # member's on a channel it is not an end of.
    await service.on_channel(head, GroupOpen(group=lead.group, channel=9, member="m2"))
    await service.on_channel(head, GroupOpen(group=lead.group, channel=9, member="m2"))
    [twice] = [c for c in closes(groups, "head") if c.channel == 9]
    assert "already open" in twice.reason
    assert not await service.relay.forward(eve, 9, relay_frame(9, b"junk"))
    assert not await service.relay.forward(m1, 9, relay_frame(9, b"junk"))
    assert not binary(groups, "m2")
    assert not binary(groups, "head")
    # Nor can an outsider close it.
    await service.on_channel(eve, GroupClose(group=lead.group, channel=9))
    assert await service.relay.forward(head, 9, relay_frame(9, b"still open"))
    assert binary(groups, "m2") == [relay_frame(9, b"still open")]


async def test_a_head_cannot_open_channels_without_bound(groups: Groups) -> None:
    _, lead = await relayed(groups)
    head = groups.swarm.workers["head"]
    limit = groups.settings.group_relay_channels
    for number in range(1, limit + 2):
        await groups.service.on_channel(head, GroupOpen(group=lead.group, channel=number,
                                                        member="m2"))
    assert len(groups.frames("m2", GroupOpen)) == limit
    [refusal] = closes(groups, "head")
    assert refusal.channel == limit + 1
    assert f"at most {limit}" in refusal.reason
    # Closing one makes room again.
    await groups.service.on_channel(head, GroupClose(group=lead.group, channel=1))
    await groups.service.on_channel(head, GroupOpen(group=lead.group, channel=limit + 1,
                                                    member="m2"))
    assert len(groups.frames("m2", GroupOpen)) == limit + 1


async def test_no_channel_before_the_lead_or_after_the_end(groups: Groups) -> None:
    add_three(groups, host=OTHER_HOUSE)
    await groups.service.tick()
    serve = await groups.frame("m2", GroupServe)
    head = groups.swarm.workers["head"]
    opening = GroupOpen(group=serve.group, channel=1, member="m2")  # type: ignore[attr-defined]
    await groups.service.on_channel(head, opening)  # still forming: the head has no lead yet
    assert "not loading" in closes(groups, "head")[0].reason
    assert not groups.frames("m2", GroupOpen)
    await groups.service.tick()  # nothing changes while forming
    groups.swarm.registry.remove(groups.swarm.workers["m1"], "test")
    groups.service.left(groups.swarm.workers["m1"])
    assert not groups.service.groups
    await groups.frame("m2", GroupEnd)
    assert not await groups.service.relay.forward(head, 1, relay_frame(1, b"late"))
    assert not binary(groups, "m2")


async def test_an_ended_group_drops_its_channels(groups: Groups) -> None:
    _, lead = await relayed(groups)
    head, m2 = groups.swarm.workers["head"], groups.swarm.workers["m2"]
    await groups.service.on_channel(head, GroupOpen(group=lead.group, channel=3, member="m2"))
    group = groups.service.by_model[MODEL]
    groups.service.end(group, "test")
    assert group.phase is Phase.ENDED
    assert not await groups.service.relay.forward(m2, 3, relay_frame(3, b"late"))
    assert not await groups.service.relay.forward(head, 3, relay_frame(3, b"late"))
    assert not binary(groups, "head")
    assert not binary(groups, "m2")
    assert groups.service.relay.usage(group.id).channels == 0


async def test_a_member_that_answers_on_the_wrong_route_ends_the_group(groups: Groups) -> None:
    add_three(groups, host=OTHER_HOUSE)
    await groups.service.tick()
    serve = await groups.frame("m2", GroupServe)
    group = groups.service.by_model[MODEL]
    # Told to wait for relayed channels, m2 points the head at an address instead.
    groups.service.on_report(groups.swarm.workers["m2"], GroupMemberReady(
        group=serve.group, host="10.0.0.9", port=40_009,  # type: ignore[attr-defined]
        fingerprint=FINGERPRINT))
    assert group.phase is Phase.ENDED
    assert "relayed serve" in group.reason
    assert groups.swarm.workers["m2"].key in groups.service._cooldown
    assert not groups.frames("head", GroupLead)


async def test_a_receiver_gone_closes_the_channel_for_the_sender(groups: Groups) -> None:
    _, lead = await relayed(groups)
    head = groups.swarm.workers["head"]
    await groups.service.on_channel(head, GroupOpen(group=lead.group, channel=2, member="m2"))
    groups.swarm.connections["m2"].broken = True
    assert await groups.service.relay.forward(head, 2, relay_frame(2, b"x"))
    [closed] = closes(groups, "head")
    assert closed.channel == 2
    assert "cannot be reached" in closed.reason
    assert not await groups.service.relay.forward(head, 2, relay_frame(2, b"x"))
