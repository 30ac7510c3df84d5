"""One job's mailbox on the queen: the frames a worker sends for it, awaited with a deadline.

``JobHandle`` is fed by the worker session's read loop and drained by the HTTP side. It is a
deque plus one waiter future and one timer, which costs far less per frame than a queue wrapped
in ``asyncio.wait_for``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared_schema import Chunk, JobError, Result

if TYPE_CHECKING:
    from queen_server.swarm.sessions import WorkerSession


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


class JobHandle:
    """A job leased to one worker, from the job frame until its end (the whole stream)."""

    __slots__ = (
        "_items",
        "_waiter",
        "cancelling",
        "finished",
        "first_at",
        "id",
        "model",
        "on_end",
        "session",
        "started_at",
    )

    def __init__(self, job_id: str, model: str, session: WorkerSession, started_at: float) -> None:
        self.id = job_id
        self.model = model
        self.session = session
        self.started_at = started_at
        self.finished = False
        self.cancelling = False
        self.first_at: float | None = None
        self.on_end: Callable[[JobHandle], None] | None = None
        self._items: deque[JobEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def feed(self, event: JobEvent) -> None:
        self._items.append(event)
        if not isinstance(event, Chunk):
            self.finished = True
            if self.on_end is not None:
                self.on_end(self)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

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
