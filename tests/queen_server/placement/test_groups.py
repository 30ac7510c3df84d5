"""The queen forming model groups (issue 19): ``GroupService`` over a real ``Registry`` and
``ModelCatalog`` (a real GGUF header of 8 layers, 4 MB each), real ``Worker``s on fake
connections that record the frames the queen sends. The workers' side is played by the test,
honest and hostile."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from queen_server.billing.shares import apportion, split_parts
from queen_server.errors import ModelLoading, NoCapacity
from queen_server.placement.groups import OUTCOME_KEEP_S, Phase
from queen_server.swarm.jobs import Part
from shared_schema import (
    GroupEnd,
    GroupFailed,
    GroupLead,
    GroupMemberReady,
    GroupReady,
    GroupServe,
)
from tests.queen_server.placement.group_harness import (
    FINGERPRINT,
    Groups,
    GroupSettings,
    add_three,
    formed,
    need_mb,
    sizes,
    up,
)
from tests.queen_server.placement.harness import MODEL


async def test_a_group_forms_and_only_its_ready_head_is_routed(groups: Groups) -> None:
    add_three(groups)
    await groups.service.tick()
    group = groups.service.by_model[MODEL]
    assert group.phase is Phase.FORMING
    # Group-only now: the lone holder is out of routing, and the members are held.
    assert groups.holders() == set()
    assert {w.public_id for w in groups.swarm.registry if w.held_by == group.id} == {"m1", "m2"}
    assert len(groups.frames("head", GroupServe)) == 0
    s1 = await groups.frame("m1", GroupServe)
    s2 = await groups.frame("m2", GroupServe)
    assert s1.head == s2.head == "head"  # type: ignore[attr-defined]
    assert s1.token != s2.token  # type: ignore[attr-defined]  # one per link
    groups.ready("m1", s1, 40_001)  # type: ignore[arg-type]
    assert not groups.frames("head", GroupLead)  # not before every member is ready
    groups.ready("m2", s2, 40_002)  # type: ignore[arg-type]
    lead = await groups.frame("head", GroupLead)
    assert isinstance(lead, GroupLead)
    assert {m.worker_id: (m.port, m.token) for m in lead.members} == {
        "m1": (40_001, s1.token), "m2": (40_002, s2.token)}  # type: ignore[attr-defined]
    assert sum(lead.head_layers) + sum(sum(m.device_layers) for m in lead.members) == 8
    assert lead.sha256 == groups.swarm.catalog.pin(MODEL).sha256  # type: ignore[union-attr]
    with pytest.raises(ModelLoading):
        groups.service.prepare(MODEL)
    groups.service.on_report(groups.swarm.workers["head"],
                             GroupReady(group=lead.group, load_s=1.5))
    await up(group)
    assert groups.holders() == {"head"}
    groups.service.prepare(MODEL)  # no error: routing serves it
    [row] = groups.service.rows()
    assert (row["phase"], row["head"]) == ("ready", "head")
    workers = [m["worker"] for m in row["members"]]  # type: ignore[attr-defined]
    assert workers[0] == "head"
    assert set(workers) == {"head", "m1", "m2"}
    # The head's part of an answer is credited to the three by layers held.
    head = groups.swarm.workers["head"]
    group_id, shares = groups.service.credit(head, MODEL)
    assert group_id == group.id
    assert sum(n for _, n in shares) == 8
    assert groups.service.credit(groups.swarm.workers["m1"], MODEL) == ("", ())
    parts = split_parts([Part(head.key, 100, 30, shares=shares)])
    assert sum(p.prompt_tokens for p in parts) == 100
    assert sum(p.completion_tokens for p in parts) == 30
    assert {p.worker_key for p in parts} == {groups.swarm.workers[n].key
                                             for n in ("head", "m1", "m2")}


async def test_a_member_that_leaves_ends_the_group_and_frees_the_rest(groups: Groups) -> None:
    serve, _, lead = await formed(groups)
    head = groups.swarm.workers["head"]
    groups.service.on_report(head, GroupReady(group=lead.group, load_s=1.0))
    group = groups.service.by_model[MODEL]
    await up(group)
    gone = groups.swarm.workers["m1"]
    groups.swarm.registry.remove(gone, "test")
    groups.service.left(gone)
    assert group.phase is Phase.ENDED
    assert MODEL not in groups.service.by_model
    end_head = await groups.frame("head", GroupEnd)
    end_m2 = await groups.frame("m2", GroupEnd)
    assert end_head.group == end_m2.group == serve.group  # type: ignore[attr-defined]
    assert groups.swarm.workers["m2"].held_by is None
    assert groups.holders() == set()  # group-only: the head alone is not routed
    with pytest.raises(NoCapacity) as refused:
        groups.service.prepare(MODEL)
    assert refused.value.code == "group_unavailable"
    # Two workers left cannot hold it: the model is no longer group-only, the holder is routed
    # as before groups (at its owner's risk).
    await groups.service.tick()
    assert MODEL not in groups.service.by_model
    assert MODEL not in groups.service.group_only
    assert groups.holders() == {"head"}


async def test_a_member_that_fails_is_left_out_of_the_next_plan(groups: Groups) -> None:
    serve, _, _ = await formed(groups)
    groups.add("m3", sizes(groups)[1])
    groups.service.on_report(groups.swarm.workers["m1"], GroupFailed(
        group=serve.group, code="server_failed", message="the RPC server died"))
    assert MODEL not in groups.service.by_model
    assert (await groups.frame("head", GroupEnd)).group == serve.group  # type: ignore[attr-defined]
    await groups.service.tick()
    group = groups.service.by_model[MODEL]
    assert set(group.members) == {groups.swarm.workers[n].key for n in ("m2", "m3")}


async def test_the_member_the_head_names_short_of_memory_is_left_out_not_the_head(
        groups: Groups) -> None:
    """A member that claimed more memory than it has fails the head's load; the head (a
    worker the queen trusts) names it, so the next plan keeps the head and drops that member."""
    serve, _, _ = await formed(groups)
    groups.add("m3", sizes(groups)[1])
    head = groups.swarm.workers["head"]
    groups.service.on_report(head, GroupFailed(
        group=serve.group, code="load_failed", member="m1",
        message="the RPC server at 127.0.0.1:40001 could not allocate the layers it was given"))
    assert (await groups.frame("m2", GroupEnd)).group == serve.group  # type: ignore[attr-defined]
    await groups.service.tick()
    group = groups.service.by_model[MODEL]
    assert group.head is head
    assert set(group.members) == {groups.swarm.workers[n].key for n in ("m2", "m3")}


@pytest.mark.parametrize(("reporter", "named", "left_out"), [
    ("m2", "m1", "m2"),  # a member cannot get another one left out: it is blamed itself
    ("head", "eve", "head"),  # a head naming a worker not in its group blames itself
    ("head", "head", "head"),  # nor can it name itself as a member
])
async def test_only_the_head_names_a_member_and_only_one_of_its_own(
        groups: Groups, reporter: str, named: str, left_out: str) -> None:
    serve, _, _ = await formed(groups)
    groups.add("m3", sizes(groups)[1])
    groups.add("eve", 1)
    groups.service.on_report(groups.swarm.workers[reporter], GroupFailed(
        group=serve.group, code="load_failed", member=named, message="out of memory"))
    assert MODEL not in groups.service.by_model
    await groups.service.tick()
    group = groups.service.by_model.get(MODEL)
    taken = set() if group is None else {w.public_id for w in group.parts}
    assert left_out not in taken
    if left_out != "head":
        assert named in taken  # the worker it named was not punished


async def test_frames_from_outsiders_and_out_of_turn_change_nothing(groups: Groups) -> None:
    serve, _, lead = await formed(groups)
    group = groups.service.by_model[MODEL]
    outsider = groups.add("eve", 1)
    service = groups.service
    # An outsider cannot end it, claim a member's place or say the head is ready.
    service.on_report(outsider, GroupFailed(group=serve.group, code="lost"))
    service.on_report(outsider, GroupReady(group=serve.group, load_s=0))
    service.on_report(outsider, GroupMemberReady(group=serve.group, host="10.0.0.1",
                                                 port=4444, fingerprint=FINGERPRINT))
    # A member cannot say the head is ready; a ready for an unknown group is ignored.
    service.on_report(groups.swarm.workers["m1"], GroupReady(group=serve.group, load_s=0))
    service.on_report(groups.swarm.workers["head"], GroupReady(group="f" * 16, load_s=0))
    for _ in range(20):
        await asyncio.sleep(0)
    assert group.phase is Phase.LOADING
    assert groups.holders() == set()
    service.on_report(groups.swarm.workers["head"], GroupReady(group=lead.group, load_s=0))
    await up(group)


async def test_a_member_that_never_answers_ends_the_group(big_header: bytes) -> None:
    made = Groups(big_header, GroupSettings(group_setup_timeout_s=0.2))
    await made.pin()
    try:
        add_three(made)
        await made.service.tick()
        serve = await made.frame("m1", GroupServe)
        made.ready("m1", serve)  # type: ignore[arg-type]
        end = await made.frame("m1", GroupEnd)  # m2 stays silent past the deadline
        assert "m2" in end.reason  # type: ignore[attr-defined]
        assert made.swarm.workers["m1"].held_by is None
        assert made.swarm.workers["m2"].key in made.service._cooldown
    finally:
        await made.service.stop()
        await made.swarm.catalog.close()


async def test_no_group_for_a_model_one_worker_holds_or_without_a_trusted_head(
        groups: Groups) -> None:
    groups.settings.group_heads = []  # nobody may lead
    add_three(groups)
    await groups.service.tick()
    assert MODEL not in groups.service.by_model
    assert "no_trusted_head" in groups.service.outcomes[MODEL]
    assert groups.holders() == {"head"}  # not group-only: routing as before
    groups.settings.group_heads = ["*"]
    groups.add("roomy", need_mb(groups) * 3)  # one worker could hold it: no group
    await groups.service.tick()
    assert MODEL not in groups.service.by_model
    assert "fits_one_worker" in groups.service.outcomes[MODEL]


async def test_the_outcome_of_a_model_nobody_holds_any_more_is_forgotten(
        groups: Groups) -> None:
    """The admin page lists models worth a group, and for an hour those no longer worth one
    (why their group ended), not every model planned since the queen started."""
    groups.settings.group_heads = []
    add_three(groups)
    await groups.service.tick()
    assert MODEL in groups.service.outcomes
    head = groups.swarm.workers["head"]
    groups.swarm.registry.remove(head, "test")  # the only worker holding the file leaves
    groups.service.left(head)
    await groups.service.tick()
    assert MODEL in groups.service.outcomes  # still said, for a while
    groups.swarm.clock.now += OUTCOME_KEEP_S + 1
    await groups.service.tick()
    assert MODEL not in groups.service.outcomes


async def test_members_on_another_lan_are_not_grouped_without_a_relay(groups: Groups) -> None:
    groups.settings.group_relay = False  # the operator carries no group traffic
    add_three(groups, host="198.51.100.9")  # m2 is in another household
    await groups.service.tick()
    assert MODEL not in groups.service.by_model
    assert "no_direct_route" in groups.service.outcomes[MODEL]
    assert not groups.frames("m1", GroupServe)


def test_apportion_keeps_the_sum_and_the_proportions() -> None:
    assert apportion(10, [3, 3, 2]) == [4, 4, 2]
    assert apportion(0, [1, 2]) == [0, 0]
    for total in range(0, 50):
        for weights in ([1], [1, 1], [5, 2, 1], [0, 3, 7], [10, 10, 1]):
            shares = apportion(total, weights)
            assert sum(shares) == total
            for share, weight in zip(shares, weights, strict=True):
                assert abs(share - total * weight / sum(weights)) < 1
    with pytest.raises(ValueError, match="hold nothing"):
        apportion(5, [0, 0])


def test_split_parts_leaves_other_workers_parts_alone() -> None:
    head = hashlib.sha256(b"h").hexdigest()
    parts = [Part("other", 10, 5, completed=False), Part(head, 7, 9)]
    parts[1] = Part(head, 7, 9, shares=((head, 2), ("m1", 1)))
    out = split_parts(parts)
    assert out[0] == parts[0]
    assert out[1:] == [Part(head, 5, 6), Part("m1", 2, 3)]
