"""The cross-replica job path end to end: two "replicas" in one process, over the in-process
bus and over a real redis-server, with a toy handler in place of the dispatcher."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from queen_server.cluster.bus import Bus
from queen_server.cluster.directory import MemoryDirectory, ReplicaInfo
from queen_server.cluster.errors import ReplicaUnavailable
from queen_server.cluster.remote import (
    Emitter,
    JobServer,
    RemoteJob,
    RemoteJobClient,
    job_channel,
    reply_channel,
)
from queen_server.cluster.resp import Published
from queen_server.swarm.jobs import JobEvent, WorkerLost
from shared_schema import Chunk, JobError, Result, Usage
from shared_schema.cluster import (
    Assigned,
    ClusterEvent,
    ClusterEvents,
    ClusterJob,
    Lost,
    decode_cluster,
    encode_cluster,
)
from tests.queen_server.cluster.conftest import until
from tests.support.redis_server import RedisServer, bus_seal

BusFactory = Callable[[], Awaitable[Bus]]


def chunk(job_id: str, i: int) -> Chunk:
    return Chunk(id=job_id, seq=i, data={"choices": [{"index": 0, "delta": {"content": f"t{i}"}}]})


@dataclass
class Toy:
    """A handler standing in for the dispatcher on the serving replica."""

    chunks: int = 50
    hang_after: int | None = None  # stop sending after this many chunks, and wait forever
    end: str = "result"  # "result", "error", "nothing", "raise"
    delay_s: float = 0.0  # before its first frame (a worker still reading the prompt)
    started: list[ClusterJob] = field(default_factory=list)
    cancelled: list[str | None] = field(default_factory=list)
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, job: ClusterJob, emit: Emitter) -> None:
        self.started.append(job)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            await emit(Assigned(worker_key="lnurl-of-w1", worker_id="w1", sha256="ab" * 32))
            for i in range(self.chunks):
                if self.hang_after is not None and i == self.hang_after:
                    await asyncio.Event().wait()
                await emit(chunk(job.job_id, i))
            if self.end == "result":
                await emit(Result(id=job.job_id, usage=Usage(prompt_tokens=3,
                                                             completion_tokens=self.chunks,
                                                             total_tokens=3 + self.chunks)))
            elif self.end == "error":
                await emit(JobError(id=job.job_id, code="busy", message="full", retryable=True))
            elif self.end == "raise":
                raise RuntimeError("the handler broke")
        except asyncio.CancelledError:
            self.cancelled.append(emit.cancel_reason)
            raise
        finally:
            self.finished.set()


@dataclass
class Pair:
    server_bus: Bus
    client_bus: Bus
    client: RemoteJobClient
    directory: MemoryDirectory
    now: list[float]
    serve: Callable[[Toy], Awaitable[JobServer]]


@pytest.fixture
async def pair(bus_factory: BusFactory) -> AsyncIterator[Pair]:
    server_bus, client_bus = await bus_factory(), await bus_factory()
    now = [0.0]
    directory = MemoryDirectory(ttl_s=5.0, clock=lambda: now[0])
    await directory.heartbeat(ReplicaInfo("A"))
    client = await RemoteJobClient(client_bus, "B", directory=directory, accept_s=1.0,
                                   idle_s=0.6, watch_s=0.05).start()
    servers: list[JobServer] = []

    async def serve(toy: Toy) -> JobServer:
        server = await JobServer(server_bus, "A", toy, keepalive_s=0.2).start()
        servers.append(server)
        return server

    yield Pair(server_bus, client_bus, client, directory, now, serve)
    await client.close()
    for server in servers:
        await server.close()


async def submit(pair: Pair, job_id: str = "req1.1", **kwargs: object) -> RemoteJob:
    return await pair.client.submit("A", job_id=job_id, model="m", openai_url="/v1/chat",
                                    openai_req={"messages": []}, timeout_s=30.0, **kwargs)


async def drain(job: RemoteJob) -> list[JobEvent]:
    return [event async for event in job]


async def test_events_arrive_whole_and_in_order(pair: Pair) -> None:
    toy = Toy(chunks=200)
    await pair.serve(toy)
    job = await submit(pair, continuation="so far", needs={"grammar": "response_format"},
                       billed=True)
    events = await asyncio.wait_for(drain(job), 10)
    assert [e.data["choices"][0]["delta"]["content"] for e in events[:-1]] == \
        [f"t{i}" for i in range(200)]
    assert isinstance(events[-1], Result)
    assert events[-1].usage.completion_tokens == 200
    sent = toy.started[0]
    assert (sent.origin, sent.reply_to, sent.continuation, sent.needs, sent.billed) == \
        ("B", reply_channel("B"), "so far", {"grammar": "response_format"}, True)
    assert pair.client.jobs == {}
    assert job.assigned == Assigned(worker_key="lnurl-of-w1", worker_id="w1", sha256="ab" * 32)


async def test_many_jobs_at_once_each_get_their_own_events(pair: Pair) -> None:
    await pair.serve(Toy(chunks=20))
    jobs = [await submit(pair, job_id=f"r{i}.1") for i in range(20)]
    for i, events in enumerate(await asyncio.wait_for(
            asyncio.gather(*(drain(job) for job in jobs)), 10)):
        assert len(events) == 21
        assert all(event.id == f"r{i}.1" for event in events)


async def test_events_can_go_to_a_sink(pair: Pair) -> None:
    await pair.serve(Toy(chunks=5, end="error"))
    got: list[JobEvent] = []
    await submit(pair, sink=got.append)
    await until(lambda: len(got) == 6, what="six events in the sink")
    assert isinstance(got[-1], JobError)
    assert got[-1].retryable


async def test_cancel_reaches_the_serving_replica(pair: Pair) -> None:
    toy = Toy(chunks=10, hang_after=3)
    server = await pair.serve(toy)
    job = await submit(pair)
    for _ in range(3):
        assert isinstance(await job.next(asyncio.get_running_loop().time() + 5), Chunk)
    await job.cancel("client went away")
    await asyncio.wait_for(toy.finished.wait(), 5)
    assert toy.cancelled == ["client went away"]
    await until(lambda: not server.running, what="the server forgot the job")


async def test_a_dead_server_is_lost_within_the_idle_deadline(pair: Pair) -> None:
    toy = Toy(chunks=10, hang_after=2)
    server = await pair.serve(toy)
    job = await submit(pair)
    loop = asyncio.get_running_loop()
    await job.next(loop.time() + 5)
    await job.next(loop.time() + 5)
    # While it hangs, keep-alives keep the job alive past the idle deadline...
    await asyncio.sleep(1.0)
    assert job.job_id in pair.client.jobs
    # ...until the server dies without a word (its tasks stop; no Lost is sent).
    for task in [*server._tasks, *(t for t, _ in server.running.values())]:
        task.cancel()
    started = loop.time()
    lost = await job.next(loop.time() + 5)
    assert isinstance(lost, WorkerLost)
    assert "sent nothing for 0.6 s" in lost.reason
    assert loop.time() - started < 0.6 + 0.5
    assert await drain(job) == []


async def test_a_replica_whose_heartbeat_expired_is_lost(pair: Pair) -> None:
    await pair.serve(Toy(chunks=10, hang_after=1))
    job = await submit(pair)
    assert isinstance(await job.next(asyncio.get_running_loop().time() + 5), Chunk)
    pair.now[0] += 10.0  # A's heartbeat is older than the directory's TTL
    lost = await job.next(asyncio.get_running_loop().time() + 5)
    assert isinstance(lost, WorkerLost)
    assert "heartbeat expired" in lost.reason


async def test_a_job_nobody_accepts_is_lost_after_the_accept_deadline(pair: Pair) -> None:
    swallow = await pair.server_bus.subscribe(job_channel("A"))  # listens, never answers
    job = await submit(pair)
    lost = await job.next(asyncio.get_running_loop().time() + 5)
    assert isinstance(lost, WorkerLost)
    assert "sent nothing for 1 s" in lost.reason
    swallow.close()


async def test_no_replica_listening_is_refused_at_once(pair: Pair) -> None:
    with pytest.raises(ReplicaUnavailable, match="not listening"):
        await submit(pair)
    assert pair.client.jobs == {}


async def test_a_handler_that_ends_without_an_answer_or_fails_gives_a_lost(pair: Pair) -> None:
    await pair.serve(Toy(chunks=2, end="nothing"))
    events = await asyncio.wait_for(drain(await submit(pair, job_id="x.1")), 5)
    assert isinstance(events[-1], WorkerLost)
    assert "without an answer" in events[-1].reason


async def test_a_handler_that_raises_gives_a_lost(pair: Pair) -> None:
    await pair.serve(Toy(chunks=2, end="raise"))
    events = await asyncio.wait_for(drain(await submit(pair)), 5)
    assert len(events) == 3
    assert isinstance(events[-1], WorkerLost)
    assert "the handler broke" in events[-1].reason


async def test_a_closing_server_ends_its_jobs_with_a_lost(pair: Pair) -> None:
    toy = Toy(chunks=10, hang_after=1)
    server = await pair.serve(toy)
    job = await submit(pair)
    assert isinstance(await job.next(asyncio.get_running_loop().time() + 5), Chunk)
    await server.close()
    lost = await job.next(asyncio.get_running_loop().time() + 5)
    assert isinstance(lost, WorkerLost)
    assert "shutting down" in lost.reason


async def test_when_the_origin_stops_listening_the_server_stops_the_job(pair: Pair) -> None:
    toy = Toy(chunks=1000, hang_after=1)
    server = await pair.serve(toy)
    job = await submit(pair)
    assert isinstance(await job.next(asyncio.get_running_loop().time() + 5), Chunk)
    await pair.client.close()  # B is gone: the next keep-alive finds no receiver
    await asyncio.wait_for(toy.finished.wait(), 5)
    await until(lambda: not server.running, what="the server dropped the job")


async def test_out_of_order_events_are_put_back_in_order_and_a_gap_is_loud(pair: Pair) -> None:
    job = await submit_to_fake(pair, "j.1")
    publish = pair.server_bus.publish
    channel = reply_channel("B")
    from shared_schema.cluster import Accepted
    for seq, frame in [(0, Accepted()), (2, chunk("j.1", 1)), (1, chunk("j.1", 0))]:
        await publish(channel, encode_cluster(ClusterEvent(job_id="j.1", seq=seq, frame=frame)))
    await publish(channel, b"not json")  # dropped, with a warning
    await publish(channel, encode_cluster(ClusterEvent(job_id="other", seq=0,
                                                       frame=chunk("x", 0))))  # not ours
    deadline = asyncio.get_running_loop().time() + 5
    assert [(await job.next(deadline)).data["choices"][0]["delta"]["content"]
            for _ in range(2)] == ["t0", "t1"]
    # Event 3 is lost; event 3 + window + 1 arrives: a gap, never a silently shorter stream.
    await publish(channel, encode_cluster(ClusterEvent(job_id="j.1", seq=100,
                                                       frame=Lost(reason="x"))))
    lost = await job.next(deadline)
    assert isinstance(lost, WorkerLost)
    assert "gap" in lost.reason


async def test_garbage_on_a_job_channel_is_dropped_and_the_server_keeps_serving(
        pair: Pair) -> None:
    toy = Toy(chunks=3)
    await pair.serve(toy)
    channel = job_channel("A")
    # Not JSON, not a cluster message, a job with a missing field, a cancel of nothing.
    for junk in (b"\xff\x00 not json", b'{"type": "nonsense"}',
                 b'{"type": "job", "job_id": "x"}',
                 b'{"type": "cancel", "job_id": "no-such-job"}'):
        await pair.client_bus.publish(channel, junk)
    events = await drain(await submit(pair, "after-junk.1"))
    assert [type(event) for event in events] == [Chunk, Chunk, Chunk, Result]
    assert [job.job_id for job in toy.started] == ["after-junk.1"]  # no junk became a job


async def submit_to_fake(pair: Pair, job_id: str) -> RemoteJob:
    """A job on a replica "A" that is only a raw subscription: the test plays the server."""
    listener = await pair.server_bus.subscribe(job_channel("A"))
    job = await submit(pair, job_id=job_id)
    listener.close()
    return job


async def test_a_redis_restart_mid_stream_fails_loudly(redis_server: RedisServer) -> None:
    from queen_server.cluster.bus import RedisBus
    server_bus = await RedisBus(redis_server.url, seal=bus_seal(), reconnect_s=0.02).start()
    client_bus = await RedisBus(redis_server.url, seal=bus_seal(), reconnect_s=0.02).start()
    client = await RemoteJobClient(client_bus, "B", accept_s=5, idle_s=5, watch_s=0.05).start()
    toy = Toy(chunks=1000, hang_after=5)
    server = await JobServer(server_bus, "A", toy, keepalive_s=0.2).start()
    try:
        job = await client.submit("A", job_id="r.1", model="m", openai_url="/v1/chat",
                                  openai_req={}, timeout_s=30)
        events = [await job.next(asyncio.get_running_loop().time() + 5) for _ in range(5)]
        assert all(isinstance(event, Chunk) for event in events)
        redis_server.restart()
        lost = await job.next(asyncio.get_running_loop().time() + 5)
        assert isinstance(lost, WorkerLost)
        assert "gap" in lost.reason
        assert await drain(job) == []  # nothing after the loss, and never a Result
        # The bus recovers by itself: once both ends are subscribed again, a new job goes
        # through end to end.
        await until(lambda: server_bus.connected and client_bus.connected, 10, "resubscribed")
        toy.hang_after = None
        toy.chunks = 3
        job = await client.submit("A", job_id="r.2", model="m", openai_url="/v1/chat",
                                  openai_req={}, timeout_s=30)
        events = await asyncio.wait_for(drain(job), 10)
        assert isinstance(events[-1], Result)
        assert len(events) == 4
    finally:
        await client.close()
        await server.close()
        await server_bus.close()
        await client_bus.close()


class CountingBus:
    """A bus that counts the round trips the serving side makes (one per ``publish_many`` or
    ``publish_soon``)."""

    def __init__(self, inner: Bus) -> None:
        self.inner = inner
        self.trips = 0
        self.messages = 0
        self.sent: list[tuple[float, bytes]] = []  # (loop time, message) of publish_soon

    async def start(self) -> CountingBus:
        return self

    async def publish(self, channel: str, data: bytes) -> int:
        self.trips += 1
        self.messages += 1
        return await self.inner.publish(channel, data)

    async def publish_many(self, channel: str, items: list[bytes]) -> list[int]:
        self.trips += 1
        self.messages += len(items)
        return await self.inner.publish_many(channel, items)

    def publish_soon(self, channel: str, items: list[bytes], done: Published) -> None:
        self.trips += 1
        self.messages += len(items)
        now = asyncio.get_running_loop().time()
        self.sent += [(now, item) for item in items]
        self.inner.publish_soon(channel, items, done)

    async def subscribe(self, channel: str, limit: int = 10_000):
        return await self.inner.subscribe(channel, limit)

    async def close(self) -> None:
        return None


async def test_a_burst_of_frames_goes_out_in_a_few_round_trips_in_order(pair: Pair) -> None:
    """The handler does not wait on the bus per frame: frames made while one batch is on its
    way go out together (one message), still numbered and in order."""
    counting = CountingBus(pair.server_bus)
    toy = Toy(chunks=300)
    server = await JobServer(counting, "A", toy, keepalive_s=0.2).start()
    try:
        events = await asyncio.wait_for(drain(await submit(pair)), 10)
    finally:
        await server.close()
    assert [e.data["choices"][0]["delta"]["content"] for e in events[:-1]] == \
        [f"t{i}" for i in range(300)]
    assert isinstance(events[-1], Result)
    # Accepted, Assigned, 300 chunks and the result: 303 frames, in far fewer trips, and as
    # far fewer bus messages (issue 40: each trip sends the frames queued meanwhile as
    # ``ClusterEvents`` of up to 256).
    assert counting.trips < 303 / 4
    assert counting.trips <= counting.messages < 303 / 4


def frame_types(message: bytes) -> list[str]:
    decoded = decode_cluster(message)
    assert isinstance(decoded, ClusterEvents)
    return [frame.type for frame in decoded.frames]


async def test_accepted_rides_with_the_first_frames_when_they_come_at_once(
        pair: Pair) -> None:
    counting = CountingBus(pair.server_bus)
    server = await JobServer(counting, "A", Toy(chunks=2), keepalive_s=0.2).start()
    try:
        events = await asyncio.wait_for(drain(await submit(pair)), 10)
    finally:
        await server.close()
    assert isinstance(events[-1], Result)
    assert frame_types(counting.sent[0][1])[:3] == ["accepted", "assigned", "chunk"]


async def test_accepted_goes_alone_when_the_first_frame_is_slow_and_the_job_lives(
        pair: Pair) -> None:
    """A worker still reading a long prompt: ``Accepted`` does not wait for it (past
    ``ACCEPT_HOLD_S``), so the origin's short first deadline (``accept_s``, 1 s here) becomes
    the idle one, and the answer arrives though it started 1.5 s later."""
    counting = CountingBus(pair.server_bus)
    loop = asyncio.get_running_loop()
    asked = loop.time()
    server = await JobServer(counting, "A", Toy(chunks=2, delay_s=1.5), keepalive_s=0.4
                             ).start()
    try:
        events = await asyncio.wait_for(drain(await submit(pair)), 10)
    finally:
        await server.close()
    assert isinstance(events[-1], Result), events
    first_at, first = counting.sent[0]
    assert frame_types(first) == ["accepted"]
    assert first_at - asked < 1.0  # it did not wait for the first frame
    assert Emitter.ACCEPT_HOLD_S < 0.5


async def test_an_origin_gone_mid_burst_stops_the_handler(pair: Pair) -> None:
    """No receiver for a batch: the next frame raises, the handler's task ends (its worker's
    job would be cancelled), nothing hangs."""
    toy = Toy(chunks=10_000_000)  # minutes of frames: it ends only if the gone origin stops it
    server = await pair.serve(toy)
    await submit(pair)
    await until(lambda: toy.started, 5, "the handler to start")
    await pair.client.close()  # the origin stops listening on its reply channel
    await asyncio.wait_for(toy.finished.wait(), 10)  # long before its last chunk
    await until(lambda: not server.running, 5, "the server to drop the job")


async def test_the_callers_cache_scope_travels_with_the_job(pair: Pair) -> None:
    # The serving replica sends it in the job frame (issue 36); the origin derived it, since it
    # holds the client.
    toy = Toy(chunks=1)
    await pair.serve(toy)
    scope = "5c" * 16
    await asyncio.wait_for(drain(await submit(pair, job_id="s1.1", cache_scope=scope)), 10)
    await asyncio.wait_for(drain(await submit(pair, job_id="s2.1")), 10)
    assert [job.cache_scope for job in toy.started] == [scope, None]
