"""An owner's family of machines (issue 34): the planner never mixes families in a group, and
workers without one group only with each other, even when a mix would fit better."""

from __future__ import annotations

import dataclasses

from queen_server.groups import GroupPlan, NoPlan, plan_group
from tests.queen_server.groups.oracle import assert_sound, llama70b, recorded

WORKERS = recorded()
BIG = llama70b()


def with_family(key: str, family: str | None) -> object:
    return dataclasses.replace(WORKERS[key], family=family)


def test_a_family_is_grouped_only_with_itself() -> None:
    # A 4090 and a pair of 3090s hold the 70B shape together. With the 3090s in one owner's
    # family and the 4090 a stranger's, no group forms; with both in the family, it does.
    mixed = [with_family("ana-4090", None), with_family("ben-3090x2", "a" * 32)]
    assert isinstance(plan_group(BIG, mixed), NoPlan)
    family = [with_family("ana-4090", "a" * 32), with_family("ben-3090x2", "a" * 32)]
    plan = plan_group(BIG, family)
    assert isinstance(plan, GroupPlan)
    assert_sound(plan, BIG, family)


def test_two_families_never_mix_and_strangers_keep_to_themselves() -> None:
    keys = ("ben-4060ti", "ana-3060", "ana-4090")
    strangers = [with_family(key, None) for key in keys]
    assert isinstance(plan_group(BIG, strangers), GroupPlan)  # three strangers together
    split = [with_family("ben-4060ti", "b" * 32), with_family("ana-3060", "a" * 32),
             with_family("ana-4090", "a" * 32)]
    assert isinstance(plan_group(BIG, split), NoPlan)  # one short of the family's three
    joined = [with_family(key, "a" * 32) for key in keys]
    plan = plan_group(BIG, joined)
    assert isinstance(plan, GroupPlan)
    assert {member.key for member in plan.members} == set(keys)
