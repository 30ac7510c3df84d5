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
from dataclasses import dataclass, field
from typing import Any

from queen_server.errors import GatewayTimeout, ModelNotFound, NoCapacity, WorkerFailed
from queen_server.settings import QueenSettings
from queen_server.stats.metrics import Metrics
from queen_server.stats.swarm import SwarmStats
from queen_server.swarm.jobs import JobEvent, JobHandle, WorkerLost
from queen_server.swarm.registry import Registry
from queen_server.swarm.routing import rank
from queen_server.swarm.sessions import WorkerSession
from shared_schema import CAPABILITY_CONTINUE, JobError, Result

log = logging.getLogger(__name__)

# After a cancel, a worker has this long to end the job before its slot is taken back anyway.
CANCEL_GRACE_S = 5.0


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


class JobRun:
    """A job under way on one worker, with its first event already received."""

    __slots__ = ("_dispatcher", "first", "handle", "request")

    def __init__(
        self, dispatcher: Dispatcher, handle: JobHandle, first: JobEvent, request: JobRequest
    ) -> None:
        self._dispatcher = dispatcher
        self.handle = handle
        self.first = first
        self.request = request

    @property
    def worker(self) -> WorkerSession:
        return self.handle.session

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
        deadline = asyncio.get_running_loop().time() + self.settings.total_timeout_s
        request = JobRequest(job_id, model, openai_url, openai_req, stream, deadline)
        return await self._launch(request, self.settings.max_attempts)

    async def fail_over(self, run: JobRun, delivered_text: str, delivered_tokens: int) -> JobRun:
        """Continue an answer whose worker failed mid-way on a twin: a worker that holds the same
        model file (same sha256) and can continue another worker's text. Call after ending
        ``run``'s lease. With nothing delivered yet, any worker of the model will do (a plain
        retry). Raises ``WorkerFailed`` when no twin is left."""
        request = run.request
        request.tried.add(run.worker.key)
        if self.metrics is not None:
            self.metrics.failovers.inc()
        if not delivered_text:
            return await self._launch(request, self.settings.max_attempts)
        descriptor = run.worker.models.get(request.model)
        sha256 = descriptor.sha256 if descriptor is not None else None
        if sha256 is None:
            raise WorkerFailed("the worker was lost mid-answer, and without the model file's "
                               "sha256 no other worker can continue it", code="worker_lost")
        openai_req = dict(request.openai_req)
        for name in ("max_tokens", "max_completion_tokens"):
            if openai_req.get(name) is not None:
                openai_req[name] = max(1, openai_req[name] - delivered_tokens)

        def twin(session: WorkerSession) -> bool:
            held = session.models.get(request.model)
            return (CAPABILITY_CONTINUE in session.capabilities and held is not None
                    and held.sha256 == sha256)

        return await self._launch(request, self.settings.max_attempts, accept=twin,
                                  continuation=delivered_text, openai_req=openai_req)

    async def _launch(
        self,
        request: JobRequest,
        attempts: int,
        *,
        accept: Callable[[WorkerSession], bool] | None = None,
        continuation: str | None = None,
        openai_req: dict[str, Any] | None = None,
    ) -> JobRun:
        """Up to ``attempts`` tries on the best acceptable workers not tried yet, until one
        sends the answer's first event."""
        loop = asyncio.get_running_loop()
        settings = self.settings
        deadline = request.deadline
        tried = request.tried
        body = request.openai_req if openai_req is None else openai_req
        last_error = "no worker answered"
        for _ in range(attempts):
            session = await self._acquire(request.model, tried, last_error, accept)
            request.attempts += 1
            handle = JobHandle(f"{request.job_id}.{request.attempts}", request.model, session,
                               loop.time())
            self.registry.lease(session, handle)
            first_deadline = deadline
            if request.stream:
                first_deadline = min(deadline, loop.time() + settings.first_token_timeout_s)
            try:
                await session.send_job(handle, request.openai_url, body, continuation)
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
            if can_fail_over(first):
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
            return JobRun(self, handle, first, request)
        raise WorkerFailed(
            f"the job failed on {len(tried)} worker(s); last error: {last_error}",
        )

    def require_servable(self, model: str) -> None:
        """404 ``model_not_found`` unless some connected worker could serve ``model``."""
        if not self.registry.candidates(model):
            raise ModelNotFound(
                f"The model '{model}' is not served by any connected worker.", param="model"
            )

    async def _acquire(
        self,
        model: str,
        tried: set[str],
        last_error: str,
        accept: Callable[[WorkerSession], bool] | None = None,
    ) -> WorkerSession:
        """The best (acceptable) worker with a free slot, waiting in the admission queue if all
        are busy."""
        registry = self.registry
        loop = asyncio.get_running_loop()
        queue_deadline: float | None = None
        while True:
            candidates = registry.candidates(model)
            if accept is not None:
                candidates = [session for session in candidates if accept(session)]
                if not candidates or all(session.key in tried for session in candidates):
                    raise WorkerFailed(
                        "the worker was lost mid-answer and no other connected worker holds "
                        f"the same model file to continue it; last error: {last_error}",
                        code="worker_lost",
                    )
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
