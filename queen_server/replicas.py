"""This queen among its replicas (issue 18): the dispatcher's ``Elsewhere``, the serving side of
other replicas' jobs, and the directory kept current.

Each replica keeps its own workers in its own registry. Once a second (``heartbeat_s``) it
tells the shared directory (``cluster.directory``) that it is alive and how many workers and
jobs it has; claims the workers that joined it (the newest connection of a key wins: a worker
that reconnected to another replica is closed here); and publishes, per model, how many of its
workers hold it and how many are free. When a request here finds no free worker, the dispatcher
asks ``replicas`` (the directory's view, cached for ``cache_s``) and sends the job to another
replica (``submit``), whose ``JobServer`` runs it through its own dispatcher (``_serve``,
local only: a job is forwarded once at most) and sends every event back in order. Billing,
metering and failover stay on the replica that holds the client; once the job is over, that
replica sends its count of the job (``outcome``) back to the serving one, which keeps the
worker's record and speed (``_recorded``): each worker's numbers have one writer, the replica
that holds it, and routing there learns from every job its workers serve.

Reports describe the whole swarm: ``gather`` asks every other replica for its part of one
(``cluster.queries``; cached for ``cache_s``, one question in flight per report), and
``swarm`` gives the counts of the last heartbeat's directory read.

With no Redis configured there is no ``Replicas``: one queen works exactly as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from queen_server.cluster.bus import Bus
from queen_server.cluster.directory import Capacity, Directory, ReplicaInfo, swarm_counts
from queen_server.cluster.queries import Answerer, Queries
from queen_server.cluster.remote import Emitter, JobServer, RemoteJob, RemoteJobClient
from queen_server.errors import ApiError, InvalidRequest
from queen_server.swarm.dispatch import Dispatcher
from queen_server.swarm.elsewhere import RemoteWorker
from queen_server.swarm.jobs import JobHandle, WorkerLost
from queen_server.swarm.registry import Registry
from shared_schema import Chunk, JobError
from shared_schema.cluster import Assigned, ClusterJob, ClusterOutcome, Lost, Query

if TYPE_CHECKING:
    from queen_server.stats.swarm import SwarmStats

log = logging.getLogger(__name__)

CLOSE_ELSEWHERE = 4009  # a worker's session closed because its key connected to another replica
CLAIM_BATCH = 64  # worker claims sent to the directory at once
MAX_SERVED = 10_000  # jobs served for other replicas whose outcome may still come


async def _no_answer(_what: Query, _arg: str | None) -> Any:
    return None


class _Run:
    """A job on another replica, as the dispatcher reads it (``swarm.elsewhere.RemoteRun``)."""

    __slots__ = ("_job",)

    def __init__(self, job: RemoteJob) -> None:
        self._job = job

    @property
    def worker(self) -> RemoteWorker | None:
        assigned = self._job.assigned
        if assigned is None:
            return None
        return RemoteWorker(assigned.worker_key, assigned.worker_id, assigned.sha256,
                            tuple((key, layers) for key, layers in assigned.shares),
                            assigned.group or "")

    async def cancel(self, reason: str) -> None:
        await self._job.cancel(reason)


class Replicas:
    def __init__(self, replica_id: str, registry: Registry, dispatcher: Dispatcher, bus: Bus,
                 directory: Directory, *, stats: SwarmStats | None = None,
                 answer: Answerer = _no_answer, address: str = "", heartbeat_s: float = 1.0,
                 cache_s: float = 1.0) -> None:
        self.replica_id = replica_id
        self.registry = registry
        self.dispatcher = dispatcher
        self.bus = bus
        self.directory = directory
        self.address = address
        self.heartbeat_s = heartbeat_s
        self.cache_s = cache_s
        self.stats = stats
        self.client = RemoteJobClient(bus, replica_id, directory=directory)
        self.server = JobServer(bus, replica_id, self._serve, on_outcome=self._recorded)
        self.queries = Queries(bus, replica_id, answer)
        self._views: dict[str, tuple[float, list[tuple[str, int]]]] = {}
        self._claimed: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        # Jobs served here for other replicas: job id -> (worker key, public id, model, the
        # jobs its worker ran as it started: ``JobHandle.load``).
        self._served: dict[str, tuple[str, str, str, int]] = {}
        self._reports: dict[tuple[str, str | None], tuple[float, asyncio.Future[Any]]] = {}
        self._alive: dict[str, ReplicaInfo] = {}
        self._alive_error: Exception | None = None
        self.beats = 0  # heartbeats done (tests wait on it)

    async def start(self) -> None:
        await self.bus.start()
        await self.client.start()
        await self.server.start()
        await self.queries.start()
        await self._beat_once()
        self._task = asyncio.create_task(self._beat(), name="replica-heartbeat")
        self.dispatcher.elsewhere = self
        log.info("replica %s: sharing the swarm with the other replicas", self.replica_id)

    async def stop(self) -> None:
        self.dispatcher.elsewhere = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.server.close()
        await self.client.close()
        await self.queries.close()
        with contextlib.suppress(Exception):
            await self.directory.remove_replica(self.replica_id)
        await self.directory.close()
        await self.bus.close()

    # --- the dispatcher's Elsewhere ---------------------------------------------------------

    async def replicas(self, model: str, exclude: Collection[str] = ()) -> list[tuple[str, int]]:
        now = time.monotonic()
        cached = self._views.get(model)
        if cached is None or now - cached[0] > self.cache_s:
            try:
                found = await self.directory.replicas_for(model, exclude=(self.replica_id,))
            except Exception as exc:  # Redis down: only this replica's workers, for now
                log.warning("the directory is unreachable: %s", exc)
                found = []
            view = [(replica, capacity.free_slots) for replica, capacity in found]
            if len(self._views) > 4096:
                self._views.clear()
            self._views[model] = cached = (now, view)
        return [entry for entry in cached[1] if entry[0] not in exclude]

    async def submit(self, replica: str, handle: JobHandle, *, model: str, openai_url: str,
                     openai_req: Mapping[str, Any], stream: bool, timeout_s: float,
                     continuation: str | None, needs: Mapping[str, str],
                     billed: bool, sha256: str | None, exclude: Collection[str],
                     regroup: str | None = None, cache_scope: str | None = None) -> _Run:
        job = await self.client.submit(
            replica, job_id=handle.id, model=model, openai_url=openai_url,
            openai_req=dict(openai_req), timeout_s=timeout_s, stream=stream,
            continuation=continuation, needs=needs, billed=billed,
            sha256=sha256, exclude=list(exclude), sink=handle.feed, regroup=regroup,
            cache_scope=cache_scope)
        return _Run(job)

    def outcome(self, replica: str, job_id: str, *, outcome: str, prompt_tokens: int,
                completion_tokens: int, total_s: float, ttft_s: float | None) -> None:
        message = ClusterOutcome(job_id=job_id, outcome=outcome[:64] or "error",
                                 prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                 total_s=max(0.0, total_s),
                                 ttft_s=max(0.0, ttft_s) if ttft_s is not None else None)
        self.client.send_outcome(replica, message)

    # --- other replicas' jobs, served here ---------------------------------------------------

    async def _serve(self, job: ClusterJob, emit: Emitter) -> None:
        """Run another replica's job on a worker of this one, and send back every event. A
        job whose model group here lost its head's answer (``regroup``) first waits for the
        group to re-form (``Dispatcher.regroup_here``)."""
        try:
            if job.regroup is not None:
                await self.dispatcher.regroup_here(job.model, job.regroup, job.timeout_s)
            run = await self.dispatcher.start(
                job.job_id, job.model, job.openai_url, job.openai_req, stream=job.stream,
                billed=job.billed, needs=job.needs, local_only=True,
                continuation=job.continuation, twin_sha256=job.sha256, exclude=job.exclude,
                cache_scope=job.cache_scope)
        except ApiError as exc:  # no worker here after all, or the request is refused
            await emit(JobError(id=job.job_id, code=exc.code or "error", message=exc.message,
                                retryable=not isinstance(exc, InvalidRequest)))
            return
        try:
            worker = run.worker
            self._remember(job.job_id, worker.key, worker.public_id, job.model,
                           run.handle.load)
            held = worker.models.get(job.model)
            await emit(Assigned(worker_key=worker.earnings_key, worker_id=worker.public_id,
                                sha256=held.sha256 if held is not None else None,
                                shares=list(run.handle.shares),
                                group=run.handle.group or None))
            event = run.first
            while True:
                if isinstance(event, WorkerLost):
                    await emit(Lost(reason=event.reason))
                    return
                await emit(event)
                if not isinstance(event, Chunk):
                    return
                event = await run.next()
        finally:
            await run.finish("the replica holding the client ended the job")

    def _remember(self, job_id: str, key: str, public_id: str, model: str, load: int) -> None:
        served = self._served
        if len(served) >= MAX_SERVED:  # outcomes that never came (their origin died)
            del served[next(iter(served))]
        served[job_id] = (key, public_id, model, load)

    def _recorded(self, message: ClusterOutcome) -> None:
        """The origin's count of a job served here: the worker's record is kept here."""
        served = self._served.pop(message.job_id, None)
        if served is None or self.stats is None:
            return
        key, public_id, model, load = served
        if message.outcome == "ok":
            self.stats.job_done(message.job_id, key, public_id, model,
                                self.dispatcher.size_class_of(model), message.prompt_tokens,
                                message.completion_tokens, message.total_s, message.ttft_s,
                                jobs=load)
        else:
            self.stats.job_failed(message.job_id, key, public_id, model, message.outcome,
                                  message.total_s)

    # --- reports of the whole swarm ---------------------------------------------------------

    async def gather(self, what: Query, arg: str | None = None) -> dict[str, Any]:
        """Every other replica's part of a report, by replica id; the same answer for
        ``cache_s``, and one question in flight per report, whatever the callers."""
        now = time.monotonic()
        key = (what, arg)
        cached = self._reports.get(key)
        if cached is None or (now - cached[0] > self.cache_s and cached[1].done()):
            if len(self._reports) > 1024:
                self._reports = {k: v for k, v in self._reports.items() if not v[1].done()}
            future: asyncio.Future[Any] = asyncio.ensure_future(self.queries.ask(what, arg))
            self._reports[key] = cached = (now, future)
        try:
            return dict(await asyncio.shield(cached[1]))
        except Exception as exc:  # the bus is down: this replica's own part only
            log.warning("the other replicas could not be asked for %s: %s", what, exc)
            return {}

    # --- the directory ----------------------------------------------------------------------

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self._beat_once()
            except Exception as exc:  # Redis down: try again next beat
                log.warning("replica heartbeat failed: %s", exc)

    async def _beat_once(self) -> None:
        registry = self.registry
        directory = self.directory
        await directory.heartbeat(ReplicaInfo(self.replica_id, self.address,
                                              workers=len(registry),
                                              jobs_in_flight=registry.leased))
        keys = {worker.key for worker in registry}
        joined = list(keys - self._claimed)
        for start in range(0, len(joined), CLAIM_BATCH):  # a burst of joins: not one by one
            await asyncio.gather(*(directory.claim_worker(key, self.replica_id)
                                   for key in joined[start:start + CLAIM_BATCH]))
        lost = set(await directory.refresh_workers(self.replica_id, keys))
        for key in lost:  # the worker connected to another replica since: that one holds it
            worker, connection = registry.get(key), registry.connection(key)
            if worker is not None and registry.remove(worker, "connected to another replica"):
                with contextlib.suppress(Exception):
                    await connection.close(CLOSE_ELSEWHERE, "connected to another replica")
        self._claimed = keys - lost
        await directory.publish_capacity(self.replica_id, self.capacity())
        try:
            self._alive, self._alive_error = await directory.alive(), None
        except Exception as exc:
            self._alive_error = exc
            raise
        self.beats += 1

    def capacity(self) -> dict[str, Capacity]:
        """Per model held here: its holders and how many of them have a free slot."""
        registry = self.registry
        return {model: Capacity(holders=len(registry.holders(model)),
                                free_slots=registry.free.free_for(model))
                for model in registry.model_names()}

    def swarm(self) -> dict[str, int]:
        """The whole swarm's counts, every replica's, as the last heartbeat read them (for
        /health and the metrics: a probe costs no Redis call). Raises the heartbeat's error
        while the directory is unreachable."""
        if self._alive_error is not None:
            raise self._alive_error
        counts = swarm_counts(self._alive)
        return {"replicas": counts.replicas, "workers": counts.workers,
                "jobs_in_flight": counts.jobs_in_flight}
