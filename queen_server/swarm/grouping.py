"""What the dispatcher asks of model groups (issue 19), and the answer when there are none.

A model too big for any one worker is served by a group: routing gives its jobs to the group's
head like to any worker, and two things differ. Who is credited: the group's shares (worker key,
layers held) as they were when the head was given the job, kept on the job (``JobHandle``), so
that a group that ends or re-forms before the books close still credits the workers that did
the work. And failover: a head that fails mid-answer has (almost always) lost a part of its
group; the dispatcher ends that group, waits for the queen to re-form one, and continues the
answer on its head (often the same worker, with another member), as it continues any answer on
a twin. ``placement.groups.GroupService`` implements ``GroupJobs``; ``NoGroups`` is the queen
without groups (and the dispatcher's default).
"""

from __future__ import annotations

from typing import Protocol

from queen_server.swarm.jobs import Shares
from queen_server.swarm.worker import Worker

__all__ = ["GroupJobs", "NoGroups"]


class GroupJobs(Protocol):
    def credit(self, worker: Worker, model: str) -> tuple[str, Shares]:
        """The id and shares of the ready group ``worker`` heads for ``model``; ("", ()) when
        it serves the model alone."""
        ...

    def job_lost(self, group: str, worker: Worker, reason: str) -> None:
        """The head of ``group`` failed a job mid-answer: end the group if it still lives."""
        ...

    async def regrouped(self, model: str, timeout_s: float) -> str | None:
        """Wait, at most ``timeout_s``, for a ready group of ``model``: None once one is, else
        why none will be (in words)."""
        ...

    def head_of(self, group: str) -> Worker | None:
        """The head of ``group`` while it lives (another replica's answer failed on it)."""
        ...


class NoGroups:
    """No model groups: every worker serves alone."""

    def credit(self, worker: Worker, model: str) -> tuple[str, Shares]:
        return "", ()

    def job_lost(self, group: str, worker: Worker, reason: str) -> None:
        return None

    async def regrouped(self, model: str, timeout_s: float) -> str | None:
        return "this queen forms no model groups"

    def head_of(self, group: str) -> Worker | None:
        return None
