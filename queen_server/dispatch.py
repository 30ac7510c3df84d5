"""Getting a job answered: pick a worker, lease it, send the job, retry before the first frame.

``Dispatcher.start`` returns a ``JobRun`` once the first frame of the answer has arrived, so that
every failure before that point can still become a proper HTTP status (404, 503, 502, 504) or a
transparent retry on the next-best worker. After that the HTTP side reads the rest of the frames
from the run and must ``finish`` it, which sends ``cancel`` to the worker if the job had not ended.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import Any

from queen_server.errors import GatewayTimeout, ModelNotFound, NoCapacity, WorkerFailed
from queen_server.jobs import JobEvent, JobHandle, WorkerLost
from queen_server.registry import Registry
from queen_server.routing import rank
from queen_server.sessions import WorkerSession
from queen_server.settings import QueenSettings
from queen_server.stats.metrics import Metrics
from queen_server.stats.swarm import SwarmStats
from shared_schema import JobError, Result

log = logging.getLogger(__name__)

# After a cancel, a worker has this long to end the job before its slot is taken back anyway.
CANCEL_GRACE_S = 5.0


class JobRun:
    """A job under way on one worker, with its first event already received."""

    __slots__ = ("_dispatcher", "attempts", "deadline", "first", "handle")

    def __init__(
        self,
        dispatcher: Dispatcher,
        handle: JobHandle,
        first: JobEvent,
        deadline: float,
        attempts: int,
    ) -> None:
        self._dispatcher = dispatcher
        self.handle = handle
        self.first = first
        self.deadline = deadline
        self.attempts = attempts

    @property
    def worker(self) -> WorkerSession:
        return self.handle.session

    async def next(self) -> JobEvent:
        """The next event of the job; ``GatewayTimeout`` past the total deadline."""
        try:
            return await self.handle.next(self.deadline)
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


class Dispatcher:
    def __init__(
        self,
        registry: Registry,
        settings: QueenSettings,
        stats: SwarmStats,
        size_class_of: Callable[[str], str],
        metrics: Metrics | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.registry = registry
        self.settings = settings
        self.stats = stats
        self.size_class_of = size_class_of
        self.metrics = metrics
        self.rng = rng or random.Random()

    def _retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(self.settings.retry_after_s)}

    async def start(
        self,
        job_id: str,
        model: str,
        openai_url: str,
        openai_req: dict[str, Any],
        *,
        stream: bool,
    ) -> JobRun:
        """Send the job to the best worker and wait for the answer's first event."""
        loop = asyncio.get_running_loop()
        settings = self.settings
        deadline = loop.time() + settings.total_timeout_s
        tried: set[str] = set()
        last_error = "no worker answered"
        for attempt in range(1, settings.max_attempts + 1):
            session = await self._acquire(model, tried, last_error)
            handle = JobHandle(f"{job_id}.{attempt}", model, session, loop.time())
            self.registry.lease(session, handle)
            first_deadline = deadline
            if stream:
                first_deadline = min(deadline, loop.time() + settings.first_token_timeout_s)
            try:
                await session.send_job(handle, openai_url, openai_req)
                first = await handle.next(first_deadline)
            except TimeoutError:
                self.record_failure(handle, "timeout")
                await self.end(handle, "timeout")
                if first_deadline < deadline:
                    raise GatewayTimeout(
                        "the worker did not start answering in time", code="first_token_timeout"
                    ) from None
                raise GatewayTimeout("the worker did not answer in time") from None
            except asyncio.CancelledError:
                await self.end(handle, "client went away")
                raise
            except Exception as exc:  # the socket broke while sending the job
                log.info("sending job %s to %r failed: %s", handle.id, session, exc)
                first = WorkerLost(f"sending the job failed: {exc}")
            handle.first_at = loop.time()
            if isinstance(first, WorkerLost) or (isinstance(first, JobError) and first.retryable):
                last_error = first.reason if isinstance(first, WorkerLost) else first.message
                log.info("job %s failed on %r before its first token: %s", handle.id, session,
                         last_error)
                self.record_failure(handle, "worker_lost" if isinstance(first, WorkerLost)
                                    else first.code)
                tried.add(session.key)
                await self.end(handle, "retrying elsewhere")
                if self.metrics is not None:
                    self.metrics.retries.inc()
                continue
            return JobRun(self, handle, first, deadline, attempt)
        raise WorkerFailed(
            f"the job failed on {len(tried)} worker(s); last error: {last_error}",
        )

    def require_servable(self, model: str) -> None:
        """404 ``model_not_found`` unless some connected worker could serve ``model``."""
        if not self.registry.candidates(model):
            raise ModelNotFound(
                f"The model '{model}' is not served by any connected worker.", param="model"
            )

    async def _acquire(self, model: str, tried: set[str], last_error: str) -> WorkerSession:
        """The best worker with a free slot, waiting in the admission queue if all are busy."""
        registry = self.registry
        loop = asyncio.get_running_loop()
        queue_deadline: float | None = None
        while True:
            candidates = registry.candidates(model)
            if not candidates:
                if tried:
                    raise WorkerFailed(
                        f"no other worker can serve this model; last error: {last_error}"
                    )
                self.require_servable(model)
            speeds = self.stats.speeds_for(self.size_class_of(model))
            for session in rank(model, candidates, speeds, self.rng, exclude=tried):
                if session.free_slots > 0:
                    return session
            if all(session.key in tried for session in candidates):
                raise WorkerFailed(
                    f"every worker serving '{model}' failed this job; last error: {last_error}"
                )
            now = loop.time()
            if queue_deadline is None:
                if registry.waiting >= self.settings.max_queued_jobs:
                    raise NoCapacity(
                        "the queue of waiting jobs is full", code="queue_full",
                        headers=self._retry_after(),
                    )
                queue_deadline = now + self.settings.queue_timeout_s
            if now >= queue_deadline:
                raise NoCapacity(
                    f"every worker serving '{model}' is busy; try again shortly",
                    headers=self._retry_after(),
                )
            await registry.wait_for_change(queue_deadline - now)

    async def end(self, handle: JobHandle, reason: str) -> None:
        """Release a job's lease. An unfinished job is cancelled on its worker first, and its
        slot stays taken until the worker ends it or ``CANCEL_GRACE_S`` passes."""
        if handle.finished or handle.session.closed:
            self._release(handle)
            return
        if handle.cancelling:
            return
        handle.cancelling = True
        handle.on_end = self._release
        try:
            await handle.session.send_cancel(handle.id, reason)
        except Exception as exc:  # the worker's socket is gone; its session cleanup follows
            log.debug("cancel of %s not sent: %s", handle.id, exc)
            self._release(handle)
            return
        asyncio.get_running_loop().call_later(CANCEL_GRACE_S, self._release, handle)

    def _release(self, handle: JobHandle) -> None:
        self.registry.release(handle)

    def record_result(self, handle: JobHandle, result: Result, *, streamed: bool) -> None:
        """A job finished: its speed, usage and time to first token go to the stats."""
        now = asyncio.get_running_loop().time()
        ttft = handle.first_at - handle.started_at if streamed and handle.first_at else None
        usage = result.usage
        session = handle.session
        self.stats.job_done(handle.id, session.key, session.public_id, handle.model,
                            self.size_class_of(handle.model), usage.prompt_tokens,
                            usage.completion_tokens, now - handle.started_at, ttft)
        if self.metrics is not None:
            self.metrics.tokens.labels("in").inc(usage.prompt_tokens)
            self.metrics.tokens.labels("out").inc(usage.completion_tokens)
            if ttft is not None:
                self.metrics.ttft.observe(ttft)

    def record_failure(self, handle: JobHandle, outcome: str) -> None:
        """A job did not finish on its worker (lost, failed, or ``timeout``)."""
        elapsed = asyncio.get_running_loop().time() - handle.started_at
        session = handle.session
        self.stats.job_failed(handle.id, session.key, session.public_id, handle.model, outcome,
                              elapsed)
