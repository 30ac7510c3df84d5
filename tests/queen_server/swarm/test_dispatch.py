"""The dispatcher against its ports alone: a registry of workers whose connections are fakes, and
a ``JobStats`` that records what it is told. No sockets, no queen."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from queen_server.swarm.dispatch import Dispatcher
from queen_server.swarm.jobs import JobHandle
from queen_server.swarm.registry import Registry
from shared_schema import Chunk, JobError, Result, Usage
from tests.queen_server.swarm.test_jobs_registry import (
    MODEL,
    DummyConnection,
    make_session,
)

USAGE = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)


@dataclass
class Knobs:
    total_timeout_s: float = 5.0
    default_max_tokens: int = 4096
    first_token_timeout_s: float = 5.0
    max_attempts: int = 3
    queue_timeout_s: float = 0.2
    max_queued_jobs: int = 10
    retry_after_s: int = 1


@dataclass
class Recorder:
    done: list[tuple[str, str, int, int]] = field(default_factory=list)
    failed: list[tuple[str, str, str]] = field(default_factory=list)
    retries: int = 0
    failovers: int = 0

    def speeds_for(self, size_class: str) -> Mapping[str, float]:
        return {}

    def speed_at(self, size_class: str, key: str, jobs: int) -> float | None:
        return None

    def job_done(self, handle: JobHandle, size_class: str, prompt_tokens: int,
                 completion_tokens: int, total_s: float, ttft_s: float | None, *,
                 here: bool = True) -> None:
        self.done.append((handle.id, handle.worker_id, prompt_tokens, completion_tokens))

    def job_failed(self, handle: JobHandle, outcome: str, elapsed_s: float, *,
                   here: bool = True) -> None:
        self.failed.append((handle.id, handle.worker_key, outcome))

    def retried(self) -> None:
        self.retries += 1

    def failed_over(self) -> None:
        self.failovers += 1


class Answering(DummyConnection):
    """A connection whose worker answers every job it is sent with ``events``, as its link
    would: fed to the job's handle, found among the worker's leases."""

    def __init__(self, registry: Registry, key: str, *events) -> None:
        super().__init__()
        self.registry, self.key, self.events = registry, key, events

    async def send_job(self, job_id: str, *args) -> None:
        await super().send_job(job_id, *args)
        handle = self.registry.leases_of(self.key)[job_id]
        for event in self.events:
            asyncio.get_running_loop().call_soon(handle.feed, event)


def dispatcher_for(registry: Registry, stats: Recorder) -> Dispatcher:
    return Dispatcher(registry, Knobs(), stats, lambda _model: "tiny", random.Random(0))


async def test_a_job_goes_out_through_the_workers_connection_and_is_reported():
    registry, stats = Registry(), Recorder()
    worker = make_session("w", loaded=(MODEL,))
    chunk = Chunk(id="x", seq=0, data={"choices": []})
    connection = Answering(registry, "w", chunk)
    registry.add(worker, connection)
    dispatcher = dispatcher_for(registry, stats)
    run = await dispatcher.start("chatcmpl-1", MODEL, "/v1/chat/completions", {"model": MODEL},
                                 stream=True)
    assert run.worker is worker
    assert run.first is chunk
    assert connection.jobs == [("chatcmpl-1.1", "/v1/chat/completions", {"model": MODEL}, None)]
    assert worker.free_slots == 0
    run.handle.feed(Result(id=run.handle.id, usage=USAGE))
    dispatcher.record_result(run.handle, USAGE, streamed=True)
    await run.finish()
    assert stats.done == [("chatcmpl-1.1", "id-w", 3, 2)]
    assert worker.free_slots == 1
    assert connection.cancels == []


async def test_finishing_an_unfinished_job_cancels_it_through_its_connection():
    registry, stats = Registry(), Recorder()
    worker = make_session("w", loaded=(MODEL,))
    connection = Answering(registry, "w", Chunk(id="x", seq=0, data={}))
    registry.add(worker, connection)
    dispatcher = dispatcher_for(registry, stats)
    run = await dispatcher.start("chatcmpl-2", MODEL, "/v1/chat/completions", {}, stream=True)
    await run.finish("client went away")
    assert connection.cancels == [("chatcmpl-2.1", "client went away")]
    assert worker.free_slots == 0  # the slot stays taken until the worker ends the job
    run.handle.feed(JobError(id=run.handle.id, code="cancelled", message="cancelled"))
    assert worker.free_slots == 1


async def test_a_retryable_error_before_the_first_token_moves_to_another_worker():
    registry, stats = Registry(), Recorder()
    flaky = make_session("flaky", loaded=(MODEL,))
    healthy = make_session("healthy", cached=(MODEL,))  # ranked after the loaded one
    error = JobError(id="x", code="oom", message="out of memory", retryable=True)
    registry.add(flaky, Answering(registry, "flaky", error))
    registry.add(healthy, Answering(registry, "healthy", Chunk(id="x", seq=0, data={})))
    dispatcher = dispatcher_for(registry, stats)
    run = await dispatcher.start("chatcmpl-3", MODEL, "/v1/chat/completions", {}, stream=True)
    assert run.worker is healthy
    assert run.handle.id == "chatcmpl-3.2"
    assert stats.failed == [("chatcmpl-3.1", "flaky", "oom")]
    assert stats.retries == 1
    assert flaky.free_slots == 1
    await run.finish()
