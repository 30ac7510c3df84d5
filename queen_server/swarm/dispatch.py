"""Getting a job answered: pick a worker, lease it, send the job, retry before the first frame.

``Dispatcher.start`` returns a ``JobRun`` once the first frame of the answer has arrived, so that
every failure before that point can still become a proper HTTP status (404, 503, 502, 504) or a
transparent retry on the next-best worker. After that the HTTP side reads the rest of the frames
from the run and must ``finish`` it, which sends ``cancel`` to the worker if the job had not ended.

The dispatcher writes to a worker through the ``Connection`` the registry holds for it, and
reaches the rest of the queen through two small ports: ``DispatchSettings`` (its knobs, which
``QueenSettings`` has) and ``JobStats`` (the speed records it routes by, and what it reports,
which ``runtime.DispatchStats`` feeds to the swarm stats and the metrics).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

from queen_server.errors import (
    GatewayTimeout,
    NoCapacity,
    RateLimited,
    WorkerFailed,
)
from queen_server.swarm.admission import IN_FLIGHT, Admission, CallerLimits
from queen_server.swarm.eligibility import Eligibility, Scores
from queen_server.swarm.elsewhere import REPLICA_PREFIX, Elsewhere, RemoteRun, view_of
from queen_server.swarm.grouping import GroupJobs, NoGroups
from queen_server.swarm.jobs import Credit, JobEvent, JobHandle, WorkerLost, answer_budget
from queen_server.swarm.registry import Registry
from queen_server.swarm.runs import JobRequest, JobRun, can_fail_over
from queen_server.swarm.worker import Connection, Worker
from shared_schema import Usage
from shared_schema.images import IMAGE_CLASS
from shared_schema.training import AdapterRef

log = logging.getLogger(__name__)

# After a cancel, a worker has this long to end the job before its slot is taken back anyway.
CANCEL_GRACE_S = 5.0
# The longest Retry-After a shed request is told (the estimate behind it can be far off).
MAX_RETRY_AFTER_S = 300
# How many times one answer may wait for its model group to re-form after losing a part.
MAX_REGROUPS = 2


class DispatchSettings(Protocol):
    """The dispatcher's knobs (``QueenSettings`` has them all)."""

    @property
    def total_timeout_s(self) -> float: ...
    @property
    def first_token_timeout_s(self) -> float: ...
    @property
    def max_attempts(self) -> int: ...
    @property
    def queue_timeout_s(self) -> float: ...
    @property
    def max_queued_jobs(self) -> int: ...
    @property
    def retry_after_s(self) -> int: ...
    @property
    def default_max_tokens(self) -> int:
        """The completion limit of a job that gives none (its answer's byte budget)."""
        ...
    @property
    def max_queued_per_key(self) -> int:
        """Jobs one caller may have waiting in the admission queue (0: no limit); read only
        for a job started with an ``Admission``."""
        ...
    @property
    def group_failover_wait_s(self) -> float:
        """How long an answer whose model group lost a part waits for it to re-form."""
        ...
    @property
    def max_concurrent_per_key(self) -> int:
        """Requests one caller may have in flight, queued or running (0: no limit); read
        only by ``Dispatcher.admit``."""
        ...
    @property
    def legacy_workers(self) -> str:
        """``"unbilled"`` keeps billed jobs off legacy workers (read for billed jobs only)."""
        ...


class JobStats(Protocol):
    """What the dispatcher reads (the workers' speed records, for routing) and reports (every
    attempt's end, retries, failovers). ``runtime.DispatchStats`` feeds the swarm stats and the
    Prometheus metrics from it."""

    def speeds_for(self, size_class: str) -> Mapping[str, float]:
        """Worker key -> seconds per completion token, for models of ``size_class`` (the
        unloaded records: jobs that ran alone on their worker)."""
        ...

    def speed_at(self, size_class: str, key: str, jobs: int) -> float | None:
        """Seconds per completion token a new stream would get on the worker of ``key`` as
        its ``jobs``-th job at once (None: no record). O(1): routing asks it per worker."""
        ...

    def job_done(self, handle: JobHandle, size_class: str, prompt_tokens: int,
                 completion_tokens: int, total_s: float, ttft_s: float | None, *,
                 here: bool = True) -> None:
        """A job ended with its result; ``ttft_s`` only for a streamed one. ``here`` is False
        for a job another replica served (its worker's record is kept there)."""
        ...

    def job_failed(self, handle: JobHandle, outcome: str, elapsed_s: float, *,
                   here: bool = True) -> None:
        """A job did not finish on its worker (``timeout``, ``worker_lost``, an error code)."""
        ...

    def retried(self) -> None:
        """A job failed before its first token and goes to another worker."""
        ...

    def failed_over(self) -> None:
        """An answer goes on on another worker after its worker failed."""
        ...


class Dispatcher:
    def __init__(
        self,
        registry: Registry,
        settings: DispatchSettings,
        stats: JobStats,
        size_class_of: Callable[[str], str],
        rng: random.Random | None = None,
        pinned: Callable[[str], Collection[str | None] | None] = lambda _model: None,
    ) -> None:
        """``pinned(model)``: the sha256s of the files a model name may be served from (issues
        17 and 39, ``Eligibility``), or None for any; workers holding another file under that
        name are not used for it."""
        self.registry = registry
        self.settings = settings
        self.stats = stats
        self._size_class_of = size_class_of
        self.rng = rng or random.Random()
        self.callers = CallerLimits()
        self.elsewhere: Elsewhere | None = None  # the other replicas, when there are any
        self.groups: GroupJobs = NoGroups()  # model groups (issue 19), when the queen forms them
        self._remote: dict[str, JobHandle] = {}  # handles of jobs on other replicas, by id
        self.eligibility = Eligibility(registry, pinned)
        registry.free.score = Scores(stats.speeds_for, self.size_class_of, stats.speed_at).score
        registry.free.rng = self.rng

    def size_class_of(self, model: str) -> str:
        """The class a model's speed records are kept under: its size class, behind
        ``IMAGE_CLASS`` for a model held as a diffusion model (issue 38: its own key). O(1)."""
        size_class = self._size_class_of(model)
        return IMAGE_CLASS + size_class if self.registry.image_holders(model) else size_class

    def admit(self, caller: str) -> Admission:
        """Count one request of ``caller`` (an API key's id, a development key's hash, an
        open-access client's address) before anything is reserved or sent for it; the caller
        must ``leave`` the ticket when the request ends. 429 (a ``rate_limit_error``) when the
        caller already has ``max_concurrent_per_key`` requests in flight or
        ``max_queued_per_key`` waiting: one caller cannot fill the queue."""
        settings = self.settings
        admission = self.callers.try_enter(caller, max_in_flight=settings.max_concurrent_per_key,
                                           max_queued=settings.max_queued_per_key)
        if isinstance(admission, Admission):
            return admission
        if admission == IN_FLIGHT:
            raise RateLimited(
                f"This caller already has {settings.max_concurrent_per_key} requests in "
                "flight; wait for one to finish before sending more.",
                code="too_many_concurrent_requests", headers=self._retry_after(),
            )
        raise self._queue_limited()

    def _queue_limited(self) -> RateLimited:
        return RateLimited(
            f"This caller already has {self.settings.max_queued_per_key} requests waiting for "
            "a worker; wait for one to start before sending more.",
            code="too_many_queued_requests", headers=self._retry_after(),
        )

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
        billed: bool = False,
        admission: Admission | None = None,
        sent: Callable[[Credit], None] | None = None,
        needs: Mapping[str, str] | None = None,
        local_only: bool = False,
        continuation: str | None = None,
        twin_sha256: str | None = None,
        exclude: Collection[str] = (),
        cache_scope: str | None = None,
        prefer: str | None = None,
        adapter: Callable[[str], AdapterRef] | None = None,
    ) -> JobRun:
        """Send the job to the best worker and wait for the answer's first event. ``billed``:
        the caller pays for it (``Principal.billed``), which may keep it off legacy workers.
        ``admission``: the caller's ticket from ``admit``; while the job waits for a worker it
        holds one of the caller's ``max_queued_per_key`` places (429 when none is left).
        The ticket stays the caller's to ``leave``. ``sent(credit)`` is told each time a
        worker is given the job (it reads the prompt from then on), so that a client who
        leaves before the first event still pays for the prompt read for it. ``needs``: the
        capabilities a worker must have (``capabilities.needs``), each with the field that
        needs it; a 400 naming that field when no connected worker of the model has them.
        ``cache_scope``: the caller's prompt-cache scope, sent with the job (and with its
        retries and failovers). ``prefer``: the key of the worker that served the
        conversation's last turn: first among the free workers of its tier (it holds the
        prefix), if it is still here and free. ``adapter``: a fine-tuned model's job
        (issue 37; ``model`` is its base, ``needs`` asks for ``lora``): each worker it is
        sent to gets ``adapter(worker key)`` as its ``Job.adapter``. Such a job is served
        by this replica's workers only (it is never relayed to another replica)."""
        settings = self.settings
        deadline = asyncio.get_running_loop().time() + settings.total_timeout_s
        request = JobRequest(job_id, model, openai_url, openai_req, stream, deadline,
                             legacy_ok=not billed or settings.legacy_workers != "unbilled",
                             billed=billed,
                             needs=needs or {}, local_only=local_only, tried=set(exclude),
                             cache_scope=cache_scope, prefer=prefer, adapter=adapter)
        # Another replica's continuation of an answer (``local_only``: it was sent here by
        # the replica holding the client) goes only to a twin of the file it names.
        accept = Eligibility.twin(model, twin_sha256) if twin_sha256 is not None else None
        return await self._launch(request, settings.max_attempts, admission=admission, sent=sent,
                                  accept=accept, continuation=continuation)

    async def fail_over(self, run: JobRun, delivered_text: str, delivered_tokens: int) -> JobRun:
        """Continue an answer whose worker failed mid-way on a twin: a worker that holds the same
        model file (same sha256) and can continue another worker's text. Call after ending
        ``run``'s lease. With nothing delivered yet, any worker of the model will do (a plain
        retry). Raises ``WorkerFailed`` when no twin is left.

        A model group's head (``handle.group``) that failed has lost a part of its group (or
        was paused, or crashed): the group is ended, and the answer waits (at most
        ``group_failover_wait_s``, ``MAX_REGROUPS`` times) for the queen to form another and
        goes on on its head, which may be the same worker."""
        request = run.request
        self.stats.failed_over()
        if not await self._regrouping(request, run.handle, run.worker):
            request.tried.add(run.worker.key)
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
        request.twin_sha256 = sha256
        return await self._launch(request, self.settings.max_attempts,
                                  accept=Eligibility.twin(request.model, sha256),
                                  continuation=delivered_text, openai_req=openai_req)

    async def _regrouping(self, request: JobRequest, handle: JobHandle, head: Worker) -> bool:
        """Whether ``request``, failed by ``handle``'s worker, waits for that worker's model
        group to re-form (at most ``MAX_REGROUPS`` times): here, now; on another replica, by
        its next attempt going there (``regroup_at``). False: not a group's head, or too many
        regroups already, and the worker counts as tried."""
        if not handle.group or request.regroups >= MAX_REGROUPS:
            return False
        if handle.replica:
            request.regroups += 1
            request.regroup_at = (handle.replica, handle.group)
        else:
            await self._regroup(request, handle.group, head)
        return True

    async def _regroup(self, request: JobRequest, group: str, head: Worker) -> None:
        """The head of ``group`` failed ``request``: end the group, and wait for another."""
        request.regroups += 1
        self.groups.job_lost(group, head, "its head failed a job")
        remaining = request.deadline - asyncio.get_running_loop().time()
        await self._await_group(request.model, remaining)

    async def regroup_here(self, model: str, group: str, timeout_s: float) -> None:
        """Another replica's answer failed on the head of ``group``, a model group here: end
        the group if it still lives, and wait (within ``timeout_s``) for the next one, whose
        head then takes the answer's continuation. ``WorkerFailed`` when none forms."""
        head = self.groups.head_of(group)
        if head is not None:
            self.groups.job_lost(group, head, "its head failed another replica's job")
        await self._await_group(model, timeout_s)

    async def _await_group(self, model: str, timeout_s: float) -> None:
        why = await self.groups.regrouped(
            model, max(0.0, min(self.settings.group_failover_wait_s, timeout_s)))
        if why is not None:
            raise WorkerFailed(f"the group of workers serving '{model}' lost a worker "
                               f"mid-answer and no new group took over: {why}",
                               code="worker_lost")

    async def _launch(
        self,
        request: JobRequest,
        attempts: int,
        *,
        accept: Callable[[Worker], bool] | None = None,
        continuation: str | None = None,
        openai_req: dict[str, Any] | None = None,
        admission: Admission | None = None,
        sent: Callable[[Credit], None] | None = None,
    ) -> JobRun:
        """Up to ``attempts`` tries on the best acceptable workers not tried yet, until one
        sends the answer's first event. Only a first start passes ``admission``: a failover
        continues an answer already admitted and is never refused for its caller's queue."""
        tried = request.tried
        body = request.openai_req if openai_req is None else openai_req
        last_error = "no worker answered"
        for _ in range(attempts):
            regroup, request.regroup_at = request.regroup_at, None
            target = regroup[0] if regroup is not None else await self._acquire(
                request.model, tried, last_error, accept, legacy_ok=request.legacy_ok,
                admission=admission, needs=request.needs, request=request,
                prefer=request.prefer)
            handle, first, worker = await self._attempt(
                request, target, body, continuation, sent,
                regroup=regroup[1] if regroup is not None else None)
            if can_fail_over(first):
                last_error = first.reason if isinstance(first, WorkerLost) else first.message
                log.info("job %s failed on %s before its first token: %s", handle.id,
                         handle.worker_id, last_error)
                self.record_failure(handle, "worker_lost" if isinstance(first, WorkerLost)
                                    else first.code)
                await self.end(handle, "retrying elsewhere")
                self.stats.retried()
                if not await self._regrouping(request, handle, worker):
                    if isinstance(target, str):
                        request.tried_replicas.add(target)
                    else:
                        tried.add(worker.key)
                continue
            return JobRun(self, worker, handle, first, request)
        raise WorkerFailed(
            f"the job failed on {len(tried)} worker(s); last error: {last_error}",
        )

    async def _attempt(
        self,
        request: JobRequest,
        target: tuple[Worker, Connection, bool] | str,
        body: dict[str, Any],
        continuation: str | None = None,
        sent: Callable[[Credit], None] | None = None,
        *,
        regroup: str | None = None,
    ) -> tuple[JobHandle, JobEvent, Worker]:
        """Give the job to ``target`` and wait for its first event: a local worker (leased
        here, its slot ``reserved`` for the job if it waited for it) or another replica (the
        job goes over the bus; no lease here, the serving replica holds one). A lost socket,
        or a replica that could not be reached, is a ``WorkerLost``; ``GatewayTimeout`` when
        no first event comes in time (for a ``regroup`` there, which first waits for its
        group to re-form: the answer's own deadline). Also returns the worker's directory
        entry (for another replica's worker: what that replica said of it,
        ``elsewhere.view_of``)."""
        loop = asyncio.get_running_loop()
        settings = self.settings
        deadline = request.deadline
        request.attempts += 1
        job_id = f"{request.job_id}.{request.attempts}"
        # What the worker may send for this attempt is tied to its ``max_tokens`` (``body``: a
        # continuation's is what is left of the answer).
        budget = answer_budget(body, settings.default_max_tokens)
        runs: list[RemoteRun] = []
        if isinstance(target, str):
            elsewhere = self.elsewhere
            assert elsewhere is not None

            async def cancel(_job_id: str, reason: str) -> None:
                for run in runs:
                    await run.cancel(reason)

            handle = JobHandle(job_id, request.model, f"{REPLICA_PREFIX}{target}", loop.time(),
                               worker_id=f"replica {target}", cancel=cancel, budget=budget,
                               replica=target)
            self._remote[handle.id] = handle

            async def send() -> None:
                runs.append(await elsewhere.submit(
                    target, handle, model=request.model, openai_url=request.openai_url,
                    openai_req=body, stream=request.stream,
                    timeout_s=max(0.1, deadline - loop.time()), continuation=continuation,
                    needs=request.needs, billed=request.billed, sha256=request.twin_sha256,
                    exclude=request.tried, regroup=regroup,
                    cache_scope=request.cache_scope))
        else:
            worker, connection, reserved = target
            handle = JobHandle(job_id, request.model, worker.key, loop.time(),
                               worker_id=worker.public_id, cancel=connection.send_cancel,
                               budget=budget)
            handle.group, handle.shares = self.groups.credit(worker, request.model)
            self.registry.lease(worker, handle, reserved=reserved)
            handle.load = len(worker.jobs)  # its worker's load as it starts, itself included

            adapter = request.adapter(worker.key) if request.adapter is not None else None

            async def send() -> None:
                if adapter is None:
                    await connection.send_job(handle.id, request.openai_url, body, continuation,
                                              request.cache_scope)
                else:
                    await connection.send_job(handle.id, request.openai_url, body, continuation,
                                              request.cache_scope, adapter=adapter)
                if sent is not None:
                    sent(Credit(worker.earnings_key, handle.shares))

        first_deadline = deadline
        if request.stream and regroup is None:
            first_deadline = min(deadline, loop.time() + settings.first_token_timeout_s)
        first: JobEvent
        try:
            await send()
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
        except Exception as exc:  # the socket broke while sending, or the replica is gone
            log.info("sending job %s to %s failed: %s", handle.id, handle.worker_id, exc)
            first = WorkerLost(f"sending the job failed: {exc}")
        handle.first_at = loop.time()
        if isinstance(target, str):  # now the serving replica has said whose worker it is
            remote = runs[0].worker if runs else None
            worker = view_of(remote, target, request.model)
            handle.worker_key, handle.worker_id = worker.key, worker.public_id
            handle.shares = remote.shares if remote is not None else ()
            handle.group = remote.group if remote is not None else ""
            if sent is not None and runs and not can_fail_over(first):
                sent(Credit(worker.earnings_key, handle.shares))
        return handle, first, worker

    async def start_on(self, worker: Worker, job_id: str, model: str, openai_url: str,
                       openai_req: dict[str, Any], *,
                       adapter: Callable[[str], AdapterRef] | None = None) -> JobRun:
        """Send a job to this one worker, now (an audit's score job to its auditor): no queue,
        no retry, not counted against any caller. ``NoCapacity`` if the worker has no free
        slot or is gone; its first event may be a failure, for the caller to read.
        ``adapter``: a fine-tuned model's job (``model`` is its base), sent with
        ``adapter(worker key)`` as its ``Job.adapter``."""
        connection = self.registry.connection(worker.key)
        if connection is None or worker.closed or worker.free_slots <= 0:
            raise NoCapacity(f"{worker.public_id} has no free slot")
        deadline = asyncio.get_running_loop().time() + self.settings.total_timeout_s
        request = JobRequest(job_id, model, openai_url, openai_req, False, deadline,
                             adapter=adapter)
        handle, first, _ = await self._attempt(request, (worker, connection, False), openai_req)
        return JobRun(self, worker, handle, first, request)

    def require_servable(self, model: str, needs: Mapping[str, str] | None = None) -> None:
        """404 ``model_not_found`` unless some connected worker here could serve ``model``;
        400 naming the field when none of them has the capabilities ``needs`` asks for."""
        self.eligibility.require_servable(model, needs)

    async def _acquire(
        self,
        model: str,
        tried: set[str],
        last_error: str,
        accept: Callable[[Worker], bool] | None = None,
        *,
        legacy_ok: bool = True,
        admission: Admission | None = None,
        needs: Mapping[str, str] | None = None,
        request: JobRequest | None = None,
        prefer: str | None = None,
    ) -> tuple[Worker, Connection, bool] | str:
        """The best (acceptable) worker with a free slot, the connection that holds it, and
        whether its slot was reserved for this job (it waited for it in the admission queue);
        or, with replicas, the id of another replica to send the job to, when no worker here
        is free and one there is (or only there are workers of the model). Without
        ``legacy_ok``, legacy workers are no candidates (a 404 if only they serve the model).
        With an ``admission``, the wait takes one of its caller's queue places, given back
        however the wait ends. ``prefer``: a worker key chosen first if free (``rank``)."""
        registry = self.registry
        settings = self.settings
        ok = self.eligibility.filter(model, tried, accept, legacy_ok, needs)
        queue_deadline: float | None = None
        try:
            while True:
                worker = registry.choose(model, ok, prefer)
                reserved = False
                if worker is None:
                    if request is not None and self.elsewhere is not None:
                        replica = await self._replica_for(model, request)
                        if replica is not None:
                            return replica
                    eligibility = self.eligibility
                    eligibility.check_servable(model, tried, last_error, accept, legacy_ok, needs)
                    if tried and not eligibility.untried_left(model, tried):
                        raise WorkerFailed(f"every worker serving '{model}' failed this job; "
                                           f"last error: {last_error}")
                    now = time.monotonic()
                    if queue_deadline is None:
                        self._may_queue(model, admission)
                        queue_deadline = now + settings.queue_timeout_s
                    if now >= queue_deadline:
                        raise self._busy(model)
                    caller = admission.caller if admission is not None else ""
                    try:
                        worker = await registry.wait_for_worker(model, caller,
                                                                queue_deadline - now, ok)
                    except TimeoutError:
                        raise self._busy(model) from None
                    if worker is None or worker.closed:
                        continue  # the swarm changed under the wait: look again
                    reserved = True
                connection = registry.connection(worker.key)
                if connection is not None:
                    return worker, connection, reserved
                if reserved:  # not reached: the registry adds and removes both together
                    registry.unreserve(worker)
                registry.free.drop(worker)
        finally:
            if admission is not None:
                admission.unqueue()

    async def _replica_for(self, model: str, request: JobRequest) -> str | None:
        """Another replica to send the job to: one with a free worker of the model, or, when
        no worker here could ever take the job, the best one there (it queues it). Never for
        a fine-tuned model's job: the bus carries no adapter (the client's replica serves it)."""
        if request.local_only or self.elsewhere is None or request.adapter is not None:
            return None
        replicas = await self.elsewhere.replicas(model, request.tried_replicas)
        for replica, free in replicas:
            if free > 0:
                return replica
        if replicas and not self.eligibility.servable(model):
            return replicas[0][0]
        return None

    async def served_elsewhere(self, model: str) -> bool:
        """Whether another replica has workers of ``model`` (False without replicas)."""
        return self.elsewhere is not None and bool(await self.elsewhere.replicas(model))

    def _may_queue(self, model: str, admission: Admission | None) -> None:
        """Refuse a job the queue cannot take: the queue is full, the caller has its share of
        it, or the wait it would have (the waiters ahead over the model's measured service
        rate) is already past the queue timeout, so it is shed now rather than failed later."""
        registry = self.registry
        settings = self.settings
        if registry.waiting >= settings.max_queued_jobs:
            raise NoCapacity("the queue of waiting jobs is full", code="queue_full",
                             headers=self._retry_after())
        expected = registry.queue.expected_wait_s(model, registry.slots(model))
        if expected is not None and expected > settings.queue_timeout_s:
            retry_s = min(MAX_RETRY_AFTER_S, max(1, math.ceil(expected - settings.queue_timeout_s)))
            raise NoCapacity(
                f"every worker serving '{model}' is busy, and the jobs waiting for them would "
                f"take about {expected:.0f} s (past the {settings.queue_timeout_s:g} s this "
                "queen waits); try again shortly", code="overloaded",
                headers={"Retry-After": str(retry_s)},
            )
        if admission is not None and not admission.try_queue(settings.max_queued_per_key):
            raise self._queue_limited()

    def _busy(self, model: str) -> NoCapacity:
        return NoCapacity(f"every worker serving '{model}' is busy; try again shortly",
                          headers=self._retry_after())

    async def end(self, handle: JobHandle, reason: str) -> None:
        """Release a job's lease. An unfinished job is cancelled on its worker first, and its
        slot stays taken until the worker ends it or ``CANCEL_GRACE_S`` passes. (A job on
        another replica has no lease here: an unfinished one is cancelled there.)"""
        if self._remote.pop(handle.id, None) is not None:
            if not handle.finished:
                handle.finished = True
                try:
                    await handle.cancel(reason)
                except Exception as exc:  # the bus is down; the serving replica's deadline ends it
                    log.debug("cancel of remote job %s not sent: %s", handle.id, exc)
            return
        if handle.finished or not self.registry.is_leased(handle.id):
            self._release(handle)  # a worker that left took its leases with it
            return
        if handle.cancelling:
            return
        handle.cancelling = True
        handle.on_end = self._release
        try:
            await handle.cancel(reason)
        except Exception as exc:  # the worker's socket is gone; its session cleanup follows
            log.debug("cancel of %s not sent: %s", handle.id, exc)
            self._release(handle)
            return
        asyncio.get_running_loop().call_later(CANCEL_GRACE_S, self._release, handle)

    def _release(self, handle: JobHandle) -> None:
        self.registry.release(handle.id)

    def record_result(self, handle: JobHandle, usage: Usage, *, streamed: bool) -> None:
        """A job finished: its speed, usage and time to first token go to the stats. ``usage``
        is the queen's bounded count (``relay.Delivered``), never the worker's claim, and the
        times are the queen's clock: a lie about tokens cannot buy a better speed record.
        A job served by another replica is recorded there (its worker's record is that
        replica's to keep): only this replica's metrics count it here."""
        now = asyncio.get_running_loop().time()
        ttft = handle.first_at - handle.started_at if streamed and handle.first_at else None
        total_s = now - handle.started_at
        here = self._tell_owner(handle, "ok", usage.prompt_tokens, usage.completion_tokens,
                                total_s, ttft)
        self.stats.job_done(handle, self.size_class_of(handle.model), usage.prompt_tokens,
                            usage.completion_tokens, total_s, ttft, here=here)

    def record_failure(self, handle: JobHandle, outcome: str) -> None:
        """A job did not finish on its worker (lost, failed, or ``timeout``)."""
        elapsed = asyncio.get_running_loop().time() - handle.started_at
        here = self._tell_owner(handle, outcome, 0, 0, elapsed, None)
        self.stats.job_failed(handle, outcome, elapsed, here=here)

    def _tell_owner(self, handle: JobHandle, outcome: str, prompt_tokens: int,
                    completion_tokens: int, total_s: float, ttft_s: float | None) -> bool:
        """Send a remote job's outcome to the replica that served it; False when it was one
        (the stats here then leave its worker's record alone)."""
        if handle.replica is None:
            return True
        if self.elsewhere is not None:
            self.elsewhere.outcome(handle.replica, handle.id, outcome=outcome,
                                   prompt_tokens=prompt_tokens,
                                   completion_tokens=completion_tokens, total_s=total_s,
                                   ttft_s=ttft_s)
        return False
