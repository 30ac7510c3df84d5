"""The queen's side of issue 34's validating gate: each member is sent its share (what the
plan put on each of its devices plus the headroom kept there), and a member whose gate refused
the head's RPC commands (``head_protocol``) gets the head blamed, only that group's head, only
once the head could have reached it, and only once per ``group_retry_s`` per member (a lying
member cannot bench every trusted head in turn)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from shared_schema import GroupEnd, GroupFailed, GroupLead, GroupServe
from tests.queen_server.placement.group_harness import (
    Groups,
    GroupSettings,
    add_three,
    formed,
    sizes,
)
from tests.queen_server.placement.harness import MODEL

RETRY_S = 300.0


@pytest.fixture
async def two_heads(big_header: bytes) -> AsyncIterator[Groups]:
    """Two workers that may head, so a blamed head can be replaced."""
    made = Groups(big_header, GroupSettings(group_heads=["head", "head2"],
                                            group_retry_s=RETRY_S))
    await made.pin()
    yield made
    await made.service.stop()
    await made.swarm.catalog.close()


def accuse(groups: Groups, member: str, group: str) -> None:
    groups.service.on_report(groups.swarm.workers[member], GroupFailed(
        group=group, code="head_protocol",
        message="the gate refused the head's ALLOC_BUFFER: past the share (over_share)"))


async def serve_of(groups: Groups, name: str, group: str) -> GroupServe:
    """The ``group_serve`` of ``group`` the queen sent ``name``, once it is sent."""
    async with asyncio.timeout(10):
        while not (found := [f for f in groups.frames(name, GroupServe) if f.group == group]):
            groups.sent.clear()
            await groups.sent.wait()
    return found[-1]


def cooling(groups: Groups) -> set[str]:
    keys = {w.key: name for name, w in groups.swarm.workers.items()}
    return {keys[k] for k in groups.service._cooldown}


async def test_each_member_is_sent_its_share_per_device(groups: Groups) -> None:
    serve, serve2, _lead = await formed(groups)
    group = groups.service.by_model[MODEL]
    claimed = sizes(groups)[1]
    for name, sent in (("m1", serve), ("m2", serve2)):
        plan = next(m for m in group.plan.members if m.key == groups.swarm.workers[name].key)
        assert sent.share_mb == list(plan.share_mb)
        assert len(sent.share_mb) == sent.devices
        # its layers with their KV cache, and nothing past what it claimed to have
        assert plan.holds_bytes <= sum(sent.share_mb) * (1 << 20)
        assert all(0 < mb <= claimed for mb in sent.share_mb)
        # the harness keeps no headroom, so a share is its layers, rounded up to a MB
        assert sum(sent.share_mb) - plan.holds_bytes / (1 << 20) < 1


async def accused_once(groups: Groups) -> None:
    """A group loading on ``head``, a spare trusted head, and m1's first accusation."""
    serve, _, _ = await formed(groups)
    groups.add("head2", sizes(groups)[0], holds=True)
    accuse(groups, "m1", serve.group)


async def test_a_member_refusing_its_loading_head_gets_the_head_blamed(
        two_heads: Groups) -> None:
    groups = two_heads
    await accused_once(groups)
    end = await groups.frame("m2", GroupEnd)
    assert "head_protocol" in end.reason  # type: ignore[attr-defined]
    assert cooling(groups) == {"head"}
    await groups.service.tick()
    group = groups.service.by_model[MODEL]  # formed again, with the other head
    assert group.head is groups.swarm.workers["head2"]
    assert groups.swarm.workers["m1"].key in group.members


async def test_a_member_cannot_blame_a_head_that_never_reached_it(groups: Groups) -> None:
    add_three(groups)
    await groups.service.tick()
    serve = await groups.frame("m1", GroupServe)  # forming: no head has dialled anyone yet
    accuse(groups, "m1", serve.group)  # type: ignore[attr-defined]
    assert cooling(groups) == {"m1"}


async def test_a_second_accusation_within_the_retry_window_blames_the_member(
        two_heads: Groups) -> None:
    groups = two_heads
    await accused_once(groups)
    assert cooling(groups) == {"head"}
    await groups.service.tick()
    group = groups.service.by_model[MODEL]
    assert group.head is groups.swarm.workers["head2"]
    for name in ("m1", "m2"):
        groups.ready(name, await serve_of(groups, name, group.id))
    assert (await groups.frame("head2", GroupLead)).group == group.id  # type: ignore[attr-defined]
    accuse(groups, "m1", group.id)
    assert cooling(groups) == {"head", "m1"}  # head2 is not blamed
    groups.swarm.clock.now += RETRY_S + 1
    await groups.service.tick()
    assert groups.service._accused == {}  # forgotten once the window passed


async def test_an_outsiders_accusation_changes_nothing(groups: Groups) -> None:
    serve, _, _ = await formed(groups)
    groups.add("eve", 1)
    accuse(groups, "eve", serve.group)
    assert MODEL in groups.service.by_model
    assert cooling(groups) == set()
