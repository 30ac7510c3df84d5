"""One job's mailbox on the queen: the frames a worker sends for it, awaited with a deadline.

``JobHandle`` is fed by the worker's link (``swarm.link``) and drained by the HTTP side. It is a
deque plus one waiter future and one timer, which costs far less per frame than a queue wrapped
in ``asyncio.wait_for``. It names its worker by key, not by object: the worker's connection may
be held by whatever edge the registry was given (``swarm.worker.Connection``), and ``cancel``
reaches it through the callable the dispatcher hands in.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from shared_schema import Chunk, JobError, Result

# The id prefix of embeddings jobs (``http.openai``); every other job is a chat completion. The
# link checks an answer's shape by it.
EMBEDDINGS_JOB = "embd-"

CancelSender = Callable[[str, str], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Part:
    """What one worker did for one request. A request that failed over mid-answer has one part
    per worker; the developer pays for their sum once, and each worker is credited its own."""

    worker_key: str | None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    completed: bool = True  # the worker ended the answer (counts as a job for its record)


@dataclass(frozen=True, slots=True)
class WorkerLost:
    """Fed to a job when its worker disconnects, is replaced, or misses its heartbeats."""

    reason: str


JobEvent = Chunk | Result | JobError | WorkerLost


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def _no_cancel(job_id: str, reason: str) -> None:
    """For a handle made without a connection (tests): there is no worker to tell."""


class JobHandle:
    """A job leased to one worker, from the job frame until its end (the whole stream).

    ``worker_key`` and ``worker_id`` (the public id) name the worker for the registry, the stats
    and the logs; ``cancel`` sends the job's cancel through whatever connection holds it.
    """

    __slots__ = (
        "_cancel",
        "_items",
        "_waiter",
        "cancelling",
        "finished",
        "first_at",
        "id",
        "model",
        "on_end",
        "started_at",
        "worker_id",
        "worker_key",
    )

    def __init__(
        self,
        job_id: str,
        model: str,
        worker_key: str,
        started_at: float,
        *,
        worker_id: str = "",
        cancel: CancelSender = _no_cancel,
    ) -> None:
        self.id = job_id
        self.model = model
        self.worker_key = worker_key
        self.worker_id = worker_id or worker_key
        self.started_at = started_at
        self.finished = False
        self.cancelling = False
        self.first_at: float | None = None
        self.on_end: Callable[[JobHandle], None] | None = None
        self._cancel = cancel
        self._items: deque[JobEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def __repr__(self) -> str:
        return f"<JobHandle {self.id} on {self.worker_id}{' finished' if self.finished else ''}>"

    def feed(self, event: JobEvent) -> None:
        self._items.append(event)
        if not isinstance(event, Chunk):
            self.finished = True
            if self.on_end is not None:
                self.on_end(self)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def cancel(self, reason: str) -> None:
        """Tell the worker to stop this job (a legacy worker's connection sends nothing)."""
        await self._cancel(self.id, reason)

    async def next(self, deadline: float) -> JobEvent:
        """The next event, or ``TimeoutError`` once the loop clock passes ``deadline``."""
        if self._items:
            return self._items.popleft()
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiter = waiter
        timer = loop.call_at(deadline, _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        if self._items:
            return self._items.popleft()
        raise TimeoutError

    def take_ready(self) -> list[JobEvent]:
        """Every event already waiting, without blocking (to batch writes to the client)."""
        items = list(self._items)
        self._items.clear()
        return items
