"""One answer's request and one attempt at it: what the dispatcher keeps for every retry and
failover of an answer (``JobRequest``), and the job under way on one worker that the HTTP side
reads (``JobRun``, from ``Dispatcher.start``). ``can_fail_over`` says which failures an answer
goes on from."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from queen_server.errors import GatewayTimeout
from queen_server.swarm.jobs import Credit, JobEvent, JobHandle, WorkerLost
from queen_server.swarm.worker import Worker
from shared_schema import JobError
from shared_schema.training import AdapterRef

__all__ = ["JobRequest", "JobRun", "Lessor", "can_fail_over"]


class Lessor(Protocol):
    """Who leased the job (``Dispatcher``): the run reports its failures and ends its lease."""

    def record_failure(self, handle: JobHandle, outcome: str) -> None: ...

    async def end(self, handle: JobHandle, reason: str) -> None: ...


@dataclass(slots=True)
class JobRequest:
    """What the client asked for, kept for every attempt and every failover of one answer."""

    job_id: str
    model: str
    openai_url: str
    openai_req: dict[str, Any]
    stream: bool
    deadline: float  # the loop time by which the whole answer must be done
    tried: set[str] = field(default_factory=set)  # workers that failed this request
    attempts: int = 0
    # False for a billed job when the ``legacy_workers`` setting is "unbilled": no legacy
    # worker, whose answers the queen cannot verify, may take it (nor a retry or failover of it).
    legacy_ok: bool = True
    billed: bool = False  # the caller pays (what another replica is told, to decide the same)
    # The capabilities a worker needs for this request, each with the field that needs it
    # (``shared_schema.capabilities.needs``): only such workers take it, retries and twins too.
    needs: Mapping[str, str] = field(default_factory=dict)
    # Replicas (issue 18): a job another replica sent here is served here or not at all;
    # replicas that failed this request; the file a continuation's twin must hold.
    local_only: bool = False
    tried_replicas: set[str] = field(default_factory=set)
    twin_sha256: str | None = None
    regroups: int = 0  # times it waited for its model group to re-form (``MAX_REGROUPS``)
    # (replica, group): the next attempt goes there, to wait for that group to re-form.
    regroup_at: tuple[str, str] | None = None
    # The caller's prompt-cache scope (issue 36), sent with every attempt; and the worker that
    # served the conversation's last turn, tried first when free (it holds the prefix).
    cache_scope: str | None = None
    prefer: str | None = None
    # A fine-tuned model (issue 37): the ``Job.adapter`` each worker (by key) is sent with the
    # job; ``model`` is then its base, and ``needs`` has the ``lora`` capability.
    adapter: Callable[[str], AdapterRef] | None = None


class JobRun:
    """A job under way on one worker, with its first event already received. ``worker`` is the
    directory entry of the worker it was leased to (still readable after the worker left)."""

    __slots__ = ("_dispatcher", "first", "handle", "request", "worker")

    def __init__(
        self,
        dispatcher: Lessor,
        worker: Worker,
        handle: JobHandle,
        first: JobEvent,
        request: JobRequest,
    ) -> None:
        self._dispatcher = dispatcher
        self.worker = worker
        self.handle = handle
        self.first = first
        self.request = request

    @property
    def credit(self) -> Credit:
        """Whom this attempt is credited to: the worker, and its group's shares if it headed
        one when it was given the job."""
        return Credit(self.worker.earnings_key, self.handle.shares)

    async def next(self) -> JobEvent:
        """The next event of the job; ``GatewayTimeout`` past the total deadline."""
        try:
            return await self.handle.next(self.request.deadline)
        except TimeoutError:
            self._dispatcher.record_failure(self.handle, "timeout")
            raise GatewayTimeout("the worker did not finish the answer in time") from None

    def record_failure(self, outcome: str) -> None:
        self._dispatcher.record_failure(self.handle, outcome)

    def take_ready(self) -> list[JobEvent]:
        return self.handle.take_ready()

    async def finish(self, reason: str = "client went away") -> None:
        """End the lease; if the job has not ended, cancel it on the worker first."""
        await self._dispatcher.end(self.handle, reason)


def can_fail_over(event: JobEvent) -> bool:
    """Whether a failure mid-answer may be continued on another worker: the worker was lost,
    or it gave up with an error it marked retryable (not a bad request)."""
    return isinstance(event, WorkerLost) or (isinstance(event, JobError) and event.retryable)
