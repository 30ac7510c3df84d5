"""A model group's state on the queen (issue 19): the settings that shape groups, a group's
phase, and the group itself (its plan, head, members, link tokens and readiness), which
``GroupService`` (``groups.py``) forms, serves and ends."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from queen_server.groups import GroupPlan, Route
from queen_server.swarm.jobs import Shares
from queen_server.swarm.worker import Worker
from shared_schema import GroupMemberReady

__all__ = ["Group", "GroupSettings", "Phase", "part_of"]


class GroupSettings(Protocol):
    @property
    def groups(self) -> bool: ...
    @property
    def group_heads(self) -> list[str]: ...
    @property
    def group_interval_s(self) -> float: ...
    @property
    def group_setup_timeout_s(self) -> float: ...
    @property
    def group_load_timeout_s(self) -> float: ...
    @property
    def group_headroom_fraction(self) -> float: ...
    @property
    def group_reserve_mb(self) -> int: ...
    @property
    def group_retry_s(self) -> float: ...
    @property
    def group_relay(self) -> bool: ...
    @property
    def group_relay_channels(self) -> int: ...


class Phase(StrEnum):
    FORMING = "forming"  # members asked to serve
    LOADING = "loading"  # the head loads the model across them
    READY = "ready"  # in routing
    ENDED = "ended"


@dataclass(eq=False)
class Group:
    id: str
    model: str
    sha256: str
    size_bytes: int
    plan: GroupPlan
    head: Worker
    members: dict[str, Worker]  # key -> worker, the head left out, in layer order
    tokens: dict[str, str]  # member key -> its link's token (hex)
    started: float
    phase: Phase = Phase.FORMING
    readies: dict[str, GroupMemberReady] = field(default_factory=dict)
    members_ready: asyncio.Event = field(default_factory=asyncio.Event)
    head_ready: asyncio.Event = field(default_factory=asyncio.Event)
    ready_at: float | None = None
    load_s: float | None = None
    reason: str = ""
    task: asyncio.Task[None] | None = None

    @property
    def parts(self) -> list[Worker]:
        return [self.head, *self.members.values()]

    def relayed(self, key: str) -> bool:
        """Whether the head reaches member ``key`` through the queen."""
        return any(m.key == key and m.route is Route.RELAYED for m in self.plan.members)

    @property
    def shares(self) -> Shares:
        """Who earns what share of an answer: (worker key, layers held), the head first."""
        return tuple((m.key, m.layers) for m in self.plan.members)


def part_of(group: Group, worker: Worker) -> bool:
    return worker is group.head or group.members.get(worker.key) is worker

