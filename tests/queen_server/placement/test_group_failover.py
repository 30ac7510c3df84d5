"""The group service's side of a group answer's failover (issue 19): what a job keeps of its
group (``credit``), a head's failed job ending its group (``job_lost``, and only a head's), and
an answer waiting for the next ready group (``regrouped``), which ends with the planner's
reason, never a hang, when no group can form."""

from __future__ import annotations

import asyncio

from queen_server.groups import Route
from queen_server.placement.groups import Phase
from shared_schema import GroupEnd, GroupLead, GroupReady, GroupServe
from tests.queen_server.placement.group_harness import Groups, formed, sizes, up
from tests.queen_server.placement.harness import MODEL, WAIT


async def frame_of(groups: Groups, name: str, kind: type, group: str):
    """The frame of ``kind`` the queen sent ``name`` about ``group`` (waits for it)."""
    async with asyncio.timeout(WAIT):
        while not (found := [f for f in groups.frames(name, kind) if f.group == group]):
            groups.sent.clear()
            await groups.sent.wait()
    return found[-1]


async def ready(groups: Groups) -> str:
    """Form the group of three and make it ready; its id."""
    _, _, lead = await formed(groups)
    groups.service.on_report(groups.swarm.workers["head"],
                             GroupReady(group=lead.group, load_s=1.0))
    await up(groups.service.by_model[MODEL])
    return lead.group


async def test_an_answer_waits_for_the_next_group_and_keeps_the_shares_of_its_own(
        groups: Groups) -> None:
    first = await ready(groups)
    groups.add("m3", sizes(groups)[1])
    head, m1, m3 = (groups.swarm.workers[n] for n in ("head", "m1", "m3"))
    group_id, shares = groups.service.credit(head, MODEL)
    assert group_id == first
    assert m1.key in dict(shares)

    groups.service.job_lost(first, head, "its head failed a job")
    assert MODEL not in groups.service.by_model
    assert (await groups.frame("m1", GroupEnd)).group == first  # type: ignore[attr-defined]
    assert groups.service.credit(head, MODEL) == ("", ())  # no group: nothing new to share
    waiting = asyncio.create_task(groups.service.regrouped(MODEL, WAIT))
    await asyncio.sleep(0)
    assert not waiting.done()

    groups.swarm.registry.remove(m1, "test")  # the member that was lost
    groups.service.left(m1)
    await groups.service.tick()
    second = groups.service.by_model[MODEL]
    assert second.id != first
    assert m3.key in second.members
    for name in ("m2", "m3"):
        groups.ready(name, await frame_of(groups, name, GroupServe, second.id))
    await frame_of(groups, "head", GroupLead, second.id)
    assert not waiting.done()  # loading is not ready
    groups.service.on_report(head, GroupReady(group=second.id, load_s=1.0))
    assert await asyncio.wait_for(waiting, WAIT) is None
    assert second.phase is Phase.READY
    # The answer's first part keeps the lost member's share; the new group shares the rest.
    assert dict(shares)[m1.key] > 0
    assert set(dict(groups.service.credit(head, MODEL)[1])) == {head.key, second.plan.keys[1],
                                                               second.plan.keys[2]}


async def test_no_group_that_can_form_ends_the_wait_with_the_planner_s_reason(
        groups: Groups) -> None:
    first = await ready(groups)
    head, m1 = groups.swarm.workers["head"], groups.swarm.workers["m1"]
    groups.swarm.registry.remove(m1, "test")
    groups.service.left(m1)
    waiting = asyncio.create_task(groups.service.regrouped(MODEL, WAIT))
    await asyncio.sleep(0)
    assert not waiting.done()
    await groups.service.tick()  # two workers cannot hold it
    why = await asyncio.wait_for(waiting, WAIT)
    assert why is not None
    assert why == groups.service.outcomes[MODEL]
    assert first not in why
    assert groups.service.credit(head, MODEL) == ("", ())


async def test_the_wait_is_bounded(groups: Groups) -> None:
    await formed(groups)  # loading, never ready
    why = await groups.service.regrouped(MODEL, 0.01)
    assert why is not None
    assert why.startswith("no group was ready within")


async def test_only_the_head_ends_its_group_by_a_lost_job(groups: Groups) -> None:
    """A member, an outsider or a wrong group id cannot end a group with ``job_lost``."""
    first = await ready(groups)
    outsider = groups.add("m9", 64)
    for worker in (groups.swarm.workers["m1"], outsider):
        groups.service.job_lost(first, worker, "failed a job")
    groups.service.job_lost("0" * 16, groups.swarm.workers["head"], "failed a job")
    group = groups.service.by_model[MODEL]
    assert group.id == first
    assert group.phase is Phase.READY
    assert not groups.frames("head", GroupEnd)


async def test_the_queen_s_measured_round_trips_choose_the_nearer_relayed_members(
        groups: Groups) -> None:
    """Every token crosses the queen twice per relayed member: of equal workers, those the
    queen measured nearer are chosen (``Worker.rtt_ms``, from its own pings)."""
    head, each = sizes(groups)
    groups.add("head", head, holds=True)
    for name, rtt_ms in (("far", 400.0), ("m1", 20.0), ("unmeasured", None), ("m2", 35.0)):
        groups.add(name, each, lan="b" * 32).rtt_ms = rtt_ms
    await groups.service.tick()
    group = groups.service.by_model[MODEL]
    assert {w.public_id for w in group.members.values()} == {"m1", "m2"}
    assert all(m.route is Route.RELAYED for m in group.plan.members[1:])


async def test_the_service_stops_with_groups_alive(groups: Groups) -> None:
    """Ending the groups on ``stop`` wakes the planning loop as it is cancelled; the stop must
    still end (it once waited for ever: ``asyncio.wait_for`` swallowed the cancellation)."""
    groups.service.start()
    await ready(groups)
    await asyncio.wait_for(groups.service.stop(), WAIT)
    assert groups.service.groups == {}
