"""A connected worker as the queen sees it: what it holds, its leased jobs, and its frames.

``WorkerSession`` speaks protocol v1; ``LegacySession`` speaks the original untyped messages.
Both write through a ``Transport`` (the websocket edge) and route the frames they read to the
``JobHandle`` of the job they name. A frame naming a job that is not in flight on this worker is
dropped; ``route`` raises ``ProtocolError`` (``unknown_job``) for it, so that the edge can say so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any, Protocol

from pydantic import ValidationError

from queen_server.swarm.jobs import JobHandle, WorkerLost
from shared_schema import (
    Cancel,
    Chunk,
    Job,
    JobError,
    LegacyRequest,
    Message,
    ModelDescriptor,
    ProtocolError,
    Result,
    Usage,
    decode,
    encode,
    loads_object,
)
from shared_schema.answers import answer_problem

log = logging.getLogger(__name__)

CAPABILITY_FETCH = "fetch_models"
# The ``ProtocolError`` code for a job frame naming a job that is not in flight on the worker.
# It is answered but not counted as a bad frame: an honest worker's frame can cross a cancel.
UNKNOWN_JOB = "unknown_job"
# The id prefix of embeddings jobs (``api.embeddings``); every other job is a chat completion.
EMBEDDINGS_JOB = "embd-"


class Transport(Protocol):
    async def send_text(self, data: str) -> None: ...
    async def close(self, code: int, reason: str) -> None: ...


class WorkerSession:
    """A protocol-v1 worker."""

    legacy = False

    def __init__(
        self,
        *,
        key: str,
        public_id: str,
        session_id: str,
        transport: Transport,
        max_jobs: int,
        models: Iterable[ModelDescriptor] = (),
        capabilities: Iterable[str] = (),
        worker_version: str = "",
        ln_url: str | None = None,
        gpus: Iterable[str] = (),
        vram_mb: int = 0,
        now: float = 0.0,
    ) -> None:
        self.key = key
        self.public_id = public_id
        self.session_id = session_id
        self.transport = transport
        self.max_jobs = max_jobs
        self.capabilities = frozenset(capabilities)
        self.worker_version = worker_version
        self.ln_url = ln_url
        self.gpus = list(gpus)
        self.vram_mb = vram_mb
        self.connected_at = time.time()
        self.last_seen = now
        self.bad_frames = 0
        self.closed = False
        self.jobs: dict[str, JobHandle] = {}
        self.models: dict[str, ModelDescriptor] = {}
        self.loaded: frozenset[str] = frozenset()
        self.cached: frozenset[str] = frozenset()
        self.set_models(models)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.public_id} jobs={len(self.jobs)}/{self.max_jobs}>"

    @property
    def can_fetch(self) -> bool:
        return CAPABILITY_FETCH in self.capabilities

    @property
    def earnings_key(self) -> str | None:
        """The key a worker's earnings are credited to (legacy workers have none)."""
        return None if self.legacy else self.key

    @property
    def free_slots(self) -> int:
        return self.max_jobs - len(self.jobs)

    def set_models(self, models: Iterable[ModelDescriptor]) -> None:
        self.models = {model.name: model for model in models}
        self.loaded = frozenset(name for name, model in self.models.items() if model.loaded)
        self.cached = frozenset(self.models)

    # --- writing ------------------------------------------------------------------------------

    async def send_job(
        self,
        handle: JobHandle,
        openai_url: str,
        openai_req: dict[str, Any],
        continuation: str | None = None,
    ) -> None:
        await self.transport.send_text(encode(Job(
            id=handle.id, openai_url=openai_url, openai_req=openai_req, continuation=continuation
        )))

    async def send_cancel(self, job_id: str, reason: str) -> None:
        await self.transport.send_text(encode(Cancel(id=job_id, reason=reason)))

    # --- reading ------------------------------------------------------------------------------

    def on_frame(self, frame: str) -> Message | None:
        """Route one frame. Job frames go to their job; other messages are returned.

        Raises ``ProtocolError`` for a frame that is not a valid message. A job frame naming a
        job that is not in flight on this worker is dropped (``route`` raises for it instead).
        """
        try:
            return self.route(frame)
        except ProtocolError as exc:
            if exc.code != UNKNOWN_JOB:
                raise
            log.warning("worker %s: %s", self.public_id, exc.message)
            return None

    def route(self, frame: str) -> Message | None:
        """``on_frame`` for the websocket edge: a job frame naming a job that is not in flight
        on this worker (someone else's, one that never was, or one of ours that has ended, as
        when a frame crosses a cancel) feeds nothing and raises ``ProtocolError`` with code
        ``unknown_job``, so that the edge can answer it."""
        message = decode(frame)
        if isinstance(message, Chunk | Result | JobError):
            handle = self.jobs.get(message.id)
            if handle is None or handle.finished:
                raise ProtocolError(
                    UNKNOWN_JOB,
                    f"job {message.id[:64]!r} is not in flight on this worker; its "
                    f"{message.type} was dropped",
                )
            problem = answer_problem(message, embeddings=message.id.startswith(EMBEDDINGS_JOB))
            if problem is not None:
                # The job fails (retryable: another worker may answer it), and the worker is told.
                handle.feed(JobError(id=message.id, code="invalid_answer", retryable=True,
                                     message=f"the worker's {message.type} was malformed: "
                                             f"{problem}"))
                raise ProtocolError("invalid_message", f"{message.type}.data: {problem}")
            handle.feed(message)
            return None
        return message

    def fail_all(self, reason: str) -> None:
        """Tell every job on this worker that the worker is gone."""
        for handle in list(self.jobs.values()):
            if not handle.finished:
                handle.feed(WorkerLost(reason))


class LegacySession(WorkerSession):
    """A worker from before protocol v1: bare requests, bare answers, one job at a time.

    It registers no models; it is assumed able to fetch whatever it is asked for, so it ranks
    in the lowest routing tier for every model.
    """

    legacy = True

    def __init__(self, **kwargs: Any) -> None:
        kwargs["max_jobs"] = 1
        super().__init__(**kwargs)

    @property
    def can_fetch(self) -> bool:
        return True

    async def send_job(
        self,
        handle: JobHandle,
        openai_url: str,
        openai_req: dict[str, Any],
        continuation: str | None = None,
    ) -> None:
        """Legacy workers never get a continuation: they lack the ``continue`` capability."""
        request = LegacyRequest(openai_url=openai_url, openai_req={**openai_req, "stream": False})
        await self.transport.send_text(request.model_dump_json())

    async def send_cancel(self, job_id: str, reason: str) -> None:
        """Legacy workers cannot be cancelled: the answer is dropped when it arrives."""

    def route(self, frame: str) -> Message | None:
        return self.on_frame(frame)

    def on_frame(self, frame: str) -> Message | None:
        body = loads_object(frame)
        handle = next(iter(self.jobs.values()), None)
        if handle is None or handle.finished:
            log.warning("legacy worker %s answered with no job in flight; dropped", self.public_id)
            return None
        if "error" in body:
            detail = body["error"] if isinstance(body["error"], dict) else {}
            handle.feed(
                JobError(
                    id=handle.id,
                    code=str(detail.get("code") or "worker_error"),
                    message=str(detail.get("message") or body["error"])[:2000],
                    retryable=True,
                )
            )
            return None
        if not isinstance(body.get("choices") or body.get("data"), list):
            raise ProtocolError("invalid_message", "legacy answer has neither choices nor data")
        try:
            usage = Usage.model_validate(body.get("usage"), extra="ignore")
        except ValidationError:
            usage = Usage(prompt_tokens=0, total_tokens=0)
        result = Result(id=handle.id, data=body, usage=usage)
        problem = answer_problem(result, embeddings=handle.id.startswith(EMBEDDINGS_JOB))
        if problem is not None:
            handle.feed(JobError(id=handle.id, code="invalid_answer", retryable=True,
                                 message=f"the legacy worker's answer was malformed: {problem}"))
            raise ProtocolError("invalid_message", f"answer: {problem}")
        handle.feed(result)
        return None
