"""The two ends of the cross-replica job path, on the bus, without the dispatcher.

On the replica that holds the client (B), ``RemoteJobClient.submit`` sends a ``ClusterJob`` to
the serving replica's job channel and returns a ``RemoteJob``: the job's events in order, as the
same ``JobEvent``s a local worker's ``JobHandle`` gets (``Chunk``, ``Result``, ``JobError``,
``WorkerLost``), into its own mailbox or into a ``sink`` (``JobHandle.feed``), so that relay,
billing and failover on B work unchanged. Everything that means the answer may not arrive whole
becomes one ``WorkerLost`` and ends the job: a gap in the sequence numbers or a bus reset, the
idle deadline passed (``accept_s`` until the serving replica acknowledged the job, then
``idle_s``; the server sends keep-alives while it is quiet), the serving replica's heartbeat
gone from the directory, or its own ``Lost``. After such an end, a cancel goes to the server
(best effort), since its worker may still be running.

On the serving replica (A), ``JobServer`` reads its job channel and runs ``handler(job, emit)``
for each job in a task of its own; ``emit(frame)`` numbers the frame and sends it to the job's
reply channel. A ``ClusterCancel`` cancels the handler's task (its ``finally`` ends the worker's
lease and cancels the worker's job, as a client going away does on one queen). A handler that
returns without a result or error, or raises, ends the job with a ``Lost``; if the origin no
longer listens (no receiver), ``emit`` raises ``ReplicaUnavailable`` and the handler is
cancelled. Once the job is over, the origin sends a ``ClusterOutcome`` (its own count of the
usage and times) on the same channel, for ``on_outcome``: the serving replica keeps its worker's
record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from queen_server.cluster.bus import Bus, BusGap, Subscription
from queen_server.cluster.errors import BusUnavailable, ReplicaUnavailable
from queen_server.cluster.stream import Gap, ReplyStream, Sequencer
from queen_server.swarm.jobs import JobEvent, Mailbox, WorkerLost
from shared_schema import Chunk, JobError, ProtocolError, Result
from shared_schema.cluster import (
    MAX_BATCH_EVENTS,
    TERMINAL_FRAMES,
    Accepted,
    AnyClusterMessage,
    Assigned,
    ClusterCancel,
    ClusterEvent,
    ClusterEvents,
    ClusterJob,
    ClusterOutcome,
    Frame,
    KeepAlive,
    Lost,
    decode_cluster,
    encode_cluster,
    encode_events,
)

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "apiary"
DEFAULT_ACCEPT_S = 2.0
DEFAULT_IDLE_S = 5.0
DEFAULT_KEEPALIVE_S = 1.0


def job_channel(replica_id: str, namespace: str = DEFAULT_NAMESPACE) -> str:
    return f"{namespace}:jobs:{replica_id}"


def reply_channel(replica_id: str, namespace: str = DEFAULT_NAMESPACE) -> str:
    return f"{namespace}:replies:{replica_id}"


def _decoded(item: bytes, channel: str) -> AnyClusterMessage | None:
    """A bus message, or None for one that is not (dropped with a warning: another process
    on the bus, or a bug, must not stop the reader)."""
    try:
        return decode_cluster(item)
    except ProtocolError as exc:
        log.warning("bad message on %s dropped: %s", channel, exc.message)
        return None


# --- the origin's side (B) -------------------------------------------------------------------


class RemoteJob(Mailbox):
    """One job served by another replica, as seen from the replica that holds its client.

    Read it like a ``JobHandle`` (the same ``Mailbox``: ``next(deadline)``, ``take_ready``) or
    iterate it; or give ``submit`` a ``sink`` and every event goes there instead. Exactly one
    terminal event is delivered (``Result``, ``JobError`` or ``WorkerLost``), and nothing
    after it.
    """

    __slots__ = ("_client", "_sink", "assigned", "ended", "job_id", "replica_id", "stream")

    def __init__(self, client: RemoteJobClient, job_id: str, replica_id: str,
                 stream: ReplyStream[Frame], sink: Callable[[JobEvent], None] | None) -> None:
        super().__init__()
        self._client = client
        self.job_id = job_id
        self.replica_id = replica_id  # the serving replica
        self.stream = stream
        self.ended = False
        self.assigned: Assigned | None = None  # the serving replica's worker, once it says
        self._sink = sink

    def __repr__(self) -> str:
        return f"<RemoteJob {self.job_id} on replica {self.replica_id}>"

    def deliver(self, event: JobEvent) -> None:
        if self.ended:
            return
        if not isinstance(event, Chunk):
            self.ended = True
        if self._sink is not None:
            self._sink(event)
        else:
            self.put(event)

    def __aiter__(self) -> RemoteJob:
        return self

    async def __anext__(self) -> JobEvent:
        if not self._items and self.ended:
            raise StopAsyncIteration
        return await self.next(asyncio.get_running_loop().time() + 3600.0)

    async def cancel(self, reason: str = "cancelled") -> None:
        """Stop the job on the serving replica (the client went away, or B gave up)."""
        await self._client.cancel(self, reason)


def _event_of(frame: Frame, replica_id: str) -> JobEvent | None:
    """The ``JobEvent`` a frame from the serving replica is on this side, or None for the
    replica's own bookkeeping frames."""
    if isinstance(frame, Chunk | Result | JobError):
        return frame
    if isinstance(frame, Lost):
        return WorkerLost(f"replica {replica_id}: {frame.reason}")
    return None


class RemoteJobClient:
    """The origin's end: submits jobs to other replicas and turns their replies into events.

    One subscription (this replica's reply channel) carries every remote job's events; one
    watcher task checks the jobs' idle deadlines and, with a ``directory``, the serving
    replicas' liveness, every ``watch_s`` seconds (O(jobs in flight) per tick).
    """

    def __init__(self, bus: Bus, replica_id: str, *, directory: Any = None,
                 namespace: str = DEFAULT_NAMESPACE, accept_s: float = DEFAULT_ACCEPT_S,
                 idle_s: float = DEFAULT_IDLE_S, watch_s: float = 0.25) -> None:
        self.bus = bus
        self.replica_id = replica_id
        self.directory = directory  # a cluster.directory.Directory, or None
        self.namespace = namespace
        self.accept_s = accept_s
        self.idle_s = idle_s
        self.watch_s = watch_s
        self.reply_to = reply_channel(replica_id, namespace)
        self.jobs: dict[str, RemoteJob] = {}
        self._sub: Subscription | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()

    async def start(self) -> RemoteJobClient:
        self._sub = await self.bus.subscribe(self.reply_to, handler=self._on_item)
        self._tasks = [asyncio.create_task(self._watch(), name="remote-jobs-watch")]
        return self

    async def submit(
        self,
        replica_id: str,
        *,
        job_id: str,
        model: str,
        openai_url: str,
        openai_req: dict[str, Any],
        timeout_s: float,
        stream: bool = True,
        continuation: str | None = None,
        needs: Mapping[str, str] | None = None,
        billed: bool = False,
        sha256: str | None = None,
        exclude: list[str] | None = None,
        sink: Callable[[JobEvent], None] | None = None,
        regroup: str | None = None,
        cache_scope: str | None = None,
    ) -> RemoteJob:
        """Send a job to ``replica_id``. ``ReplicaUnavailable`` when no replica listens on its
        channel, ``BusUnavailable`` when the bus is down: in both cases nothing reached any
        worker, and the job may go elsewhere."""
        if job_id in self.jobs:
            raise ValueError(f"job {job_id} is already in flight")
        message = ClusterJob(job_id=job_id, origin=self.replica_id, reply_to=self.reply_to,
                             model=model, openai_url=openai_url, openai_req=openai_req,
                             stream=stream, continuation=continuation, needs=dict(needs or {}),
                             billed=billed, timeout_s=timeout_s,
                             sha256=sha256, exclude=list(exclude or ())[:64],
                             regroup=regroup, cache_scope=cache_scope)
        now = asyncio.get_running_loop().time()
        job = RemoteJob(self, job_id, replica_id, ReplyStream(now, self.accept_s), sink)
        self.jobs[job_id] = job  # before publishing: in process, replies come at once
        try:
            receivers = await self.bus.publish(job_channel(replica_id, self.namespace),
                                               encode_cluster(message))
        except BaseException:
            self.jobs.pop(job_id, None)
            raise
        if receivers == 0:
            self.jobs.pop(job_id, None)
            raise ReplicaUnavailable(f"replica {replica_id} is not listening for jobs")
        return job

    async def cancel(self, job: RemoteJob, reason: str) -> None:
        job.ended = True
        if self.jobs.pop(job.job_id, None) is None:
            return
        await self._send_cancel(job, reason)

    def send_outcome(self, replica_id: str, outcome: ClusterOutcome) -> None:
        """Tell the replica that served a job how it ended (its worker's record is kept
        there), without waiting; best effort: a replica that is gone has no record to keep."""
        def sent(result: list[int] | Exception) -> None:
            if isinstance(result, Exception):
                log.info("outcome of remote job %s not sent: %s", outcome.job_id, result)

        try:
            self.bus.publish_soon(job_channel(replica_id, self.namespace),
                                  (encode_cluster(outcome),), sent)
        except BusUnavailable as exc:
            sent(exc)

    async def _send_cancel(self, job: RemoteJob, reason: str) -> None:
        try:
            await self.bus.publish(job_channel(job.replica_id, self.namespace),
                                   encode_cluster(ClusterCancel(job_id=job.job_id, reason=reason)))
        except BusUnavailable as exc:
            log.info("cancel of remote job %s not sent: %s", job.job_id, exc)

    def _lose(self, job: RemoteJob, reason: str) -> None:
        """End a job that can no longer arrive whole; tell its server to stop it."""
        if self.jobs.pop(job.job_id, None) is None:
            return
        log.warning("remote job %s on replica %s lost: %s", job.job_id, job.replica_id, reason)
        job.deliver(WorkerLost(reason))
        task = asyncio.get_running_loop().create_task(self._send_cancel(job, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _on_item(self, item: bytes | BusGap) -> None:
        """One message on the reply channel, as the bus reads it (no task per message)."""
        if isinstance(item, BusGap):
            for job in list(self.jobs.values()):
                job.stream.reset(item.reason)
                self._lose(job, f"the events from replica {job.replica_id} may have a gap "
                                f"({item.reason})")
            return
        message = _decoded(item, self.reply_to)
        if isinstance(message, ClusterEvents):
            events: Iterable[tuple[int, Frame]] = enumerate(message.frames, message.first_seq)
        elif isinstance(message, ClusterEvent):  # one event (a replica before batches)
            events = ((message.seq, message.frame),)
        else:
            return
        job = self.jobs.get(message.job_id)
        if job is None:
            return  # a late event of a job that ended here
        self._take(job, events, asyncio.get_running_loop().time())

    def _take(self, job: RemoteJob, events: Iterable[tuple[int, Frame]], now: float) -> None:
        stream = job.stream
        for seq, given in events:
            frames = stream.feed(seq, given, now, final=isinstance(given, TERMINAL_FRAMES))
            for frame in frames:
                if isinstance(frame, Accepted):
                    stream.set_idle(self.idle_s, now)
                    continue
                if isinstance(frame, Assigned):
                    job.assigned = frame
                    continue
                event = _event_of(frame, job.replica_id)
                if event is not None:
                    job.deliver(event)
            if stream.done:
                self.jobs.pop(job.job_id, None)
                return
            if isinstance(stream.failed, Gap):
                self._lose(job, f"the events from replica {job.replica_id} have a gap: "
                                f"{stream.failed.reason}")
                return

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.watch_s)
            if not self.jobs:
                continue
            now = loop.time()
            for job in list(self.jobs.values()):
                failure = job.stream.check(now)
                if isinstance(failure, Gap):
                    self._lose(job, f"the events from replica {job.replica_id} have a gap: "
                                    f"{failure.reason}")
                elif failure is not None:
                    self._lose(job, f"replica {job.replica_id} sent nothing for "
                                    f"{failure.idle_s:g} s")
            if self.directory is not None and self.jobs:
                try:
                    alive = await self.directory.alive()
                except Exception as exc:  # the directory's store is down: the bus says more
                    log.debug("directory not read: %s", exc)
                    continue
                for job in list(self.jobs.values()):
                    if job.replica_id not in alive:
                        self._lose(job, f"replica {job.replica_id}'s heartbeat expired")

    async def close(self, reason: str = "this replica is shutting down") -> None:
        for job in list(self.jobs.values()):
            self._lose(job, reason)
        for task in self._tasks:
            task.cancel()
        for task in [*self._tasks, *self._background]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._sub is not None:
            self._sub.close()


# --- the serving side (A) --------------------------------------------------------------------


class Emitter:
    """Sends one job's frames to its origin, numbered from 0 (``Accepted`` is 0). Frames
    after the terminal one are refused (``RuntimeError``): a handler bug, never sent.

    The handler does not wait on the bus for each frame: frames queue in order, and whatever
    is queued goes as one ``ClusterEvents`` message (up to ``MAX_BATCH_EVENTS`` a message,
    issue 40) at the end of the loop's round, or, while a message of this job is on its way,
    once it has arrived. So a burst of tokens costs one publish and one decode, and the first
    token never waits behind ``Accepted``'s. Nothing is made per frame but the frame (no task,
    no future: the bus calls back, ``Bus.publish_soon``). ``Accepted`` (``accept``) waits up to
    ``ACCEPT_HOLD_S`` for company: a worker that starts answering at once sends it in the
    same message as its first frames, one bus message less a job for both replicas.
    Only the terminal frame (and a backlog past ``MAX_QUEUED``) waits for the sending; an
    origin found gone (no receiver) or a bus that failed is raised at the next frame."""

    __slots__ = ("_bus", "_drained", "_error", "_first", "_hold", "_loop", "_out", "_sending",
                 "_seq", "cancel_reason", "ended", "job", "last_at")

    MAX_QUEUED = 256  # frames queued before the handler waits for the sender (backpressure)
    # How long ``Accepted`` waits for the job's first frames before it goes alone: far inside
    # the origin's ``accept_s`` (2 s), and no frame with content ever waits for it.
    ACCEPT_HOLD_S = 0.05

    def __init__(self, bus: Bus, job: ClusterJob, now: float) -> None:
        self._bus = bus
        self.job = job
        self._loop = asyncio.get_running_loop()
        self._seq = Sequencer()
        self.ended = False
        self.last_at = now
        self.cancel_reason: str | None = None  # set when the origin cancelled the job
        self._out: list[Frame] = []
        self._first = 0  # the sequence number of ``_out[0]``
        self._sending = False  # a send is due this round, or a message is on its way
        self._drained: asyncio.Future[None] | None = None  # woken once nothing is left to send
        self._error: Exception | None = None
        self._hold: asyncio.TimerHandle | None = None  # ``Accepted`` waiting for company

    def accept(self) -> None:
        """Queue ``Accepted`` (seq 0, before any other frame); it goes with the next frames,
        or alone after ``ACCEPT_HOLD_S``."""
        if self._seq.next_seq != 0:
            raise RuntimeError(f"job {self.job.job_id}: Accepted must be its first frame")
        self._seq.take()
        self._first = 0
        self._out.append(Accepted())
        self._hold = self._loop.call_later(self.ACCEPT_HOLD_S, self._held_long_enough)

    def _held_long_enough(self) -> None:
        self._hold = None
        if not self._sending:
            self._sending = True
            self._send()

    async def __call__(self, frame: Frame) -> None:
        if self._error is not None:
            raise self._error
        if self.ended:
            raise RuntimeError(f"job {self.job.job_id} already ended; {frame.type} not sent")
        terminal = isinstance(frame, TERMINAL_FRAMES)
        if terminal:
            self.ended = True
        self.last_at = self._loop.time()
        seq = self._seq.take()
        if not self._out:
            self._first = seq
        self._out.append(frame)
        if not self._sending:
            self._sending = True
            self._loop.call_soon(self._send)
        if terminal or len(self._out) > self.MAX_QUEUED:
            if self._sending:
                if self._drained is None:
                    self._drained = self._loop.create_future()
                await asyncio.shield(self._drained)
            if self._error is not None:
                raise self._error

    def _send(self) -> None:
        """Publish what is queued (``_sending`` is set); idle again once nothing is."""
        if self._hold is not None:  # ``Accepted`` found company
            self._hold.cancel()
            self._hold = None
        if not self._out or self._error is not None:
            self._idle()
            return
        batch, first, self._out = self._out, self._first, []
        messages = [encode_events(self.job.job_id, first + start,
                                  batch[start:start + MAX_BATCH_EVENTS])
                    for start in range(0, len(batch), MAX_BATCH_EVENTS)]
        try:
            self._bus.publish_soon(self.job.reply_to, messages, self._sent)
        except BusUnavailable as exc:
            self._sent(exc)

    def _sent(self, result: list[int] | Exception) -> None:
        if isinstance(result, Exception):
            self._fail(result if isinstance(result, BusUnavailable | ReplicaUnavailable)
                       else BusUnavailable(f"the bus failed: {result}"))
        elif 0 in result:
            self._fail(ReplicaUnavailable(f"replica {self.job.origin} no longer listens "
                                          f"for job {self.job.job_id}"))
        self._send()

    def _fail(self, error: Exception) -> None:
        if self._error is None:
            self._error = error
        self.ended = True
        self._out.clear()

    def _idle(self) -> None:
        self._sending = False
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    def discard(self) -> None:
        """The job's task ended without its terminal frame sent: drop what is still queued
        (a message already on its way still arrives)."""
        self._out.clear()
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None


Handler = Callable[[ClusterJob, Emitter], Awaitable[None]]
OutcomeHandler = Callable[[ClusterOutcome], None]


class JobServer:
    """The serving end: runs other replicas' jobs through ``handler`` (the lead's: dispatch
    the job to a local worker and ``emit`` every event it gets)."""

    def __init__(self, bus: Bus, replica_id: str, handler: Handler, *,
                 on_outcome: OutcomeHandler | None = None,
                 namespace: str = DEFAULT_NAMESPACE,
                 keepalive_s: float = DEFAULT_KEEPALIVE_S) -> None:
        self.bus = bus
        self.replica_id = replica_id
        self.handler = handler
        self.on_outcome = on_outcome
        self.keepalive_s = keepalive_s
        self.channel = job_channel(replica_id, namespace)
        self.running: dict[str, tuple[asyncio.Task[None], Emitter]] = {}
        self._sub: Subscription | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    async def start(self) -> JobServer:
        self._sub = await self.bus.subscribe(self.channel)
        self._tasks = [asyncio.create_task(self._read(self._sub), name="job-server-reader"),
                       asyncio.create_task(self._keep_alive(), name="job-server-keepalive")]
        return self

    async def _read(self, sub: Subscription) -> None:
        async for item in sub:
            if isinstance(item, BusGap):
                # Jobs or cancels may have been lost: their origins see no ``Accepted`` (or
                # their streams' gaps) and give up; a lost cancel ends with the job's deadline.
                log.warning("job channel %s: %s", self.channel, item.reason)
                continue
            message = _decoded(item, self.channel)
            if isinstance(message, ClusterJob):
                self._begin(message)
            elif isinstance(message, ClusterCancel):
                running = self.running.get(message.job_id)
                if running is not None:
                    running[1].cancel_reason = message.reason
                    running[0].cancel()
            elif isinstance(message, ClusterOutcome) and self.on_outcome is not None:
                try:
                    self.on_outcome(message)
                except Exception:  # a record not kept must not stop the reader
                    log.exception("outcome of job %s not recorded", message.job_id)

    def _begin(self, job: ClusterJob) -> None:
        if job.job_id in self.running or self._closing:
            return
        emitter = Emitter(self.bus, job, asyncio.get_running_loop().time())
        task = asyncio.create_task(self._run(job, emitter), name=f"remote-job-{job.job_id}")
        self.running[job.job_id] = (task, emitter)

    async def _run(self, job: ClusterJob, emitter: Emitter) -> None:
        try:
            emitter.accept()  # seq 0, before the handler's first frame
            await self.handler(job, emitter)
            if not emitter.ended:
                await emitter(Lost(reason="the serving replica ended the job without an answer"))
        except asyncio.CancelledError:
            if emitter.cancel_reason is None and not emitter.ended and self._closing:
                with contextlib.suppress(Exception):
                    await emitter(Lost(reason="the serving replica is shutting down"))
            if emitter.cancel_reason is None and not self._closing:
                raise
        except (ReplicaUnavailable, BusUnavailable) as exc:
            log.info("remote job %s from %s ended: %s", job.job_id, job.origin, exc)
        except Exception as exc:
            log.exception("remote job %s from %s failed", job.job_id, job.origin)
            if not emitter.ended:
                with contextlib.suppress(Exception):
                    await emitter(Lost(reason=f"the serving replica failed: {exc}"))
        finally:
            self.running.pop(job.job_id, None)
            if not emitter.ended:
                emitter.discard()

    async def _keep_alive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.keepalive_s / 2)
            now = loop.time()
            for task, emitter in list(self.running.values()):
                if not emitter.ended and now - emitter.last_at >= self.keepalive_s:
                    try:
                        await emitter(KeepAlive())
                    except (ReplicaUnavailable, BusUnavailable):
                        task.cancel()  # the origin is gone, or the bus: stop the worker

    async def close(self) -> None:
        """Stop taking jobs; every running one ends with a ``Lost`` to its origin."""
        self._closing = True
        if self._sub is not None:
            self._sub.close()
        for task in self._tasks:
            task.cancel()
        running = [task for task, _ in self.running.values()]
        for task in running:
            task.cancel()
        for task in [*self._tasks, *running]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
