"""Job mailboxes, the worker registry and its leases, and workers' directory entries."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from queen_server.swarm.jobs import JobHandle, WorkerLost
from queen_server.swarm.registry import Registry
from queen_server.swarm.worker import CAPABILITY_FETCH, Worker
from shared_schema import (
    Chunk,
    JobError,
    ModelDescriptor,
    Result,
    Usage,
)

MODEL = "org/repo:Q4_K_M"
OTHER = "org/other:Q8_0"
USAGE = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)


class DummyConnection:
    """A worker's connection as the registry and the dispatcher see it."""

    def __init__(self) -> None:
        self.jobs: list[tuple[str, str, dict[str, Any], str | None]] = []
        self.scopes: list[str | None] = []  # each job's cache scope, in order
        self.cancels: list[tuple[str, str]] = []
        self.closed: list[tuple[int, str]] = []

    async def send_job(self, job_id: str, openai_url: str, openai_req: dict[str, Any],
                       continuation: str | None = None, cache_scope: str | None = None) -> None:
        self.jobs.append((job_id, openai_url, openai_req, continuation))
        self.scopes.append(cache_scope)

    async def send_cancel(self, job_id: str, reason: str) -> None:
        self.cancels.append((job_id, reason))

    async def close(self, code: int, reason: str) -> None:
        self.closed.append((code, reason))


def make_session(
    key: str,
    *,
    loaded: tuple[str, ...] = (),
    cached: tuple[str, ...] = (),
    capabilities: tuple[str, ...] = ("chat",),
    max_jobs: int = 1,
) -> Worker:
    models = [ModelDescriptor(name=name, loaded=True) for name in loaded]
    models += [ModelDescriptor(name=name) for name in cached]
    return Worker(key=key, public_id=f"id-{key}", session_id=f"s-{key}", models=models,
                  capabilities=capabilities, max_jobs=max_jobs)


def make_legacy(key: str) -> Worker:
    return Worker(key=key, public_id=key, session_id=f"s-{key}", max_jobs=1, legacy=True)


def handle_on(session: Worker, job_id: str = "job-1") -> JobHandle:
    return JobHandle(job_id, MODEL, session.key, started_at=0.0, worker_id=session.public_id)


def deadline(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


def add(registry: Registry, *workers: Worker) -> list[DummyConnection]:
    connections = [DummyConnection() for _ in workers]
    for worker, connection in zip(workers, connections, strict=True):
        assert registry.add(worker, connection) is None
    return connections


# --- JobHandle ---------------------------------------------------------------------------------


async def test_next_returns_fed_events_in_order():
    handle = handle_on(make_session("w"))
    events = [
        Chunk(id="job-1", seq=0, data={"n": 0}),
        Chunk(id="job-1", seq=1, data={"n": 1}),
        Result(id="job-1", usage=USAGE),
    ]
    for event in events:
        handle.feed(event)
    got = [await handle.next(deadline(5)) for _ in events]
    assert got == events


async def test_next_wakes_when_an_event_is_fed_later():
    handle = handle_on(make_session("w"))
    loop = asyncio.get_running_loop()
    chunk = Chunk(id="job-1", seq=0, data={})
    loop.call_soon(handle.feed, chunk)
    start = loop.time()
    assert await handle.next(deadline(5)) is chunk
    assert loop.time() - start < 1


async def test_next_raises_timeout_after_its_deadline():
    handle = handle_on(make_session("w"))
    loop = asyncio.get_running_loop()
    end = loop.time() + 0.05
    with pytest.raises(TimeoutError):
        await handle.next(end)
    assert loop.time() >= end
    # The handle still works after a timeout: a later event is delivered.
    chunk = Chunk(id="job-1", seq=0, data={})
    handle.feed(chunk)
    assert await handle.next(deadline(5)) is chunk


async def test_next_with_a_past_deadline_still_returns_a_waiting_event():
    handle = handle_on(make_session("w"))
    result = Result(id="job-1", usage=USAGE)
    handle.feed(result)
    assert await handle.next(asyncio.get_running_loop().time() - 1) is result
    with pytest.raises(TimeoutError):
        await handle.next(asyncio.get_running_loop().time() - 1)


async def test_take_ready_drains():
    handle = handle_on(make_session("w"))
    assert handle.take_ready() == []
    chunks = [Chunk(id="job-1", seq=i, data={}) for i in range(3)]
    for chunk in chunks:
        handle.feed(chunk)
    first = await handle.next(deadline(5))
    assert first is chunks[0]
    assert handle.take_ready() == chunks[1:]
    assert handle.take_ready() == []
    with pytest.raises(TimeoutError):
        await handle.next(deadline(0.01))


@pytest.mark.parametrize(
    "terminal",
    [
        Result(id="job-1", usage=USAGE),
        JobError(id="job-1", code="engine_failed", message="boom"),
        WorkerLost("disconnected"),
    ],
    ids=["result", "error", "worker-lost"],
)
def test_terminal_event_sets_finished_and_calls_on_end(terminal):
    handle = handle_on(make_session("w"))
    ended: list[JobHandle] = []
    handle.on_end = ended.append
    handle.feed(Chunk(id="job-1", seq=0, data={}))
    assert handle.finished is False
    assert ended == []
    handle.feed(terminal)
    assert handle.finished is True
    assert ended == [handle]


def test_terminal_event_without_on_end():
    handle = handle_on(make_session("w"))
    handle.feed(Result(id="job-1", usage=USAGE))
    assert handle.finished is True


# --- Registry: membership and indexes ----------------------------------------------------------


async def test_registry_add_remove_and_index_by_model():
    registry = Registry()
    a = make_session("a", loaded=(MODEL,))
    b = make_session("b", cached=(MODEL, OTHER))
    c = make_session("c", cached=(OTHER,))
    add(registry, a, b, c)
    assert len(registry) == 3
    assert registry.get("b") is b
    assert registry.get("zz") is None
    assert set(registry) == {a, b, c}
    assert registry.holders(MODEL) == {a, b}
    assert registry.holders(OTHER) == {b, c}
    assert registry.holders("missing") == set()
    assert registry.model_names() == sorted([MODEL, OTHER])
    assert set(registry.candidates(MODEL)) == {a, b}
    assert registry.candidates("missing") == []

    assert registry.remove(b, "bye") is True
    assert b.closed is True
    assert registry.get("b") is None
    assert registry.holders(MODEL) == {a}
    assert registry.holders(OTHER) == {c}
    assert registry.remove(b, "again") is False

    assert registry.remove(c, "bye") is True
    assert registry.model_names() == [MODEL]
    assert len(registry) == 1


async def test_candidates_include_fetch_capable_sessions():
    registry = Registry()
    holder = make_session("holder", loaded=(MODEL,))
    fetcher = make_session("fetcher", capabilities=("chat", CAPABILITY_FETCH))
    legacy = make_legacy("legacy")
    plain = make_session("plain", cached=(OTHER,))
    add(registry, holder, fetcher, legacy, plain)
    assert fetcher.can_fetch is True
    assert legacy.can_fetch is True
    assert plain.can_fetch is False
    candidates = registry.candidates(MODEL)
    assert len(candidates) == len(set(candidates))
    assert set(candidates) == {holder, fetcher, legacy}
    # A model nobody holds can still go to the fetchers.
    assert set(registry.candidates("new/model:Q4_0")) == {fetcher, legacy}
    # Fetchers are not holders, and do not add names to the model list.
    assert registry.holders(MODEL) == {holder}
    assert registry.model_names() == sorted([MODEL, OTHER])
    registry.remove(fetcher, "gone")
    registry.remove(legacy, "gone")
    assert registry.candidates("new/model:Q4_0") == []


async def test_models_changed_reindexes():
    registry = Registry()
    session = make_session("a", cached=(MODEL,))
    add(registry, session)
    session.set_models([ModelDescriptor(name=OTHER, loaded=True)])
    registry.models_changed(session)
    assert registry.holders(MODEL) == set()
    assert registry.holders(OTHER) == {session}
    assert registry.model_names() == [OTHER]
    assert session.loaded == {OTHER}


async def test_adding_the_same_key_twice_replaces_the_older_session():
    registry = Registry()
    older = make_session("k", loaded=(MODEL,), max_jobs=2)
    [older_connection] = add(registry, older)
    first, second = handle_on(older, "j1"), handle_on(older, "j2")
    registry.lease(older, first)
    registry.lease(older, second)
    first.feed(Result(id="j1", usage=USAGE))  # already finished: gets no WorkerLost
    ended: list[JobHandle] = []
    second.on_end = ended.append

    newer = make_session("k", cached=(OTHER,))
    assert registry.add(newer, DummyConnection()) is older_connection
    assert registry.get("k") is newer
    assert len(registry) == 1
    assert older.closed is True
    assert newer.closed is False
    assert registry.holders(MODEL) == set()
    assert registry.holders(OTHER) == {newer}

    assert ended == [second]
    assert second.finished is True
    lost = second.take_ready()
    assert len(lost) == 1
    assert isinstance(lost[0], WorkerLost)
    assert "replaced" in lost[0].reason
    assert first.take_ready() == [Result(id="j1", usage=USAGE)]
    # Removing the replaced session later is a no-op that leaves the newer one alone.
    assert registry.remove(older, "late") is False
    assert registry.get("k") is newer


async def test_remove_feeds_worker_lost_to_unfinished_jobs():
    registry = Registry()
    session = make_session("a", loaded=(MODEL,))
    add(registry, session)
    handle = handle_on(session)
    registry.lease(session, handle)
    registry.remove(session, "heartbeat missed")
    event = await handle.next(deadline(5))
    assert event == WorkerLost("heartbeat missed")


async def test_lease_and_release_respect_max_jobs():
    registry = Registry()
    session = make_session("a", loaded=(MODEL,), max_jobs=2)
    add(registry, session)
    handles = [handle_on(session, f"j{i}") for i in range(3)]
    assert session.free_slots == 2
    registry.lease(session, handles[0])
    registry.lease(session, handles[1])
    assert session.free_slots == 0
    assert session.jobs == {"j0": handles[0], "j1": handles[1]}
    with pytest.raises(RuntimeError):
        registry.lease(session, handles[2])
    assert "j2" not in session.jobs
    registry.release(handles[0].id)
    assert session.free_slots == 1
    registry.lease(session, handles[2])
    assert set(session.jobs) == {"j1", "j2"}
    registry.release(handles[0].id)  # releasing twice is harmless
    assert session.free_slots == 0


async def test_legacy_session_takes_one_job_at_a_time():
    registry = Registry()
    legacy = Worker(key="l", public_id="l", session_id="s", max_jobs=8, legacy=True)
    add(registry, legacy)
    assert legacy.max_jobs == 1
    registry.lease(legacy, handle_on(legacy, "j1"))
    with pytest.raises(RuntimeError):
        registry.lease(legacy, handle_on(legacy, "j2"))


async def test_a_released_slot_is_handed_to_the_waiter_reserved():
    registry = Registry()
    session = make_session("a", loaded=(MODEL,))
    add(registry, session)
    handle = handle_on(session)
    registry.lease(session, handle)
    loop = asyncio.get_running_loop()
    seen_waiting: list[int] = []

    def release() -> None:  # runs once the waiter below is in the queue
        seen_waiting.append(registry.waiting)
        registry.release(handle.id)

    loop.call_soon(release)
    async with asyncio.timeout(5):
        worker = await registry.wait_for_worker(MODEL, "caller", 30)
    assert worker is session
    assert seen_waiting == [1]
    assert registry.waiting == 0
    # The slot is the waiter's: nobody else can take it, and it leases it as reserved.
    assert session.free_slots == 0
    assert registry.choose(MODEL) is None
    registry.lease(session, handle_on(session, "j2"), reserved=True)
    assert session.reserved == 0


async def test_a_waiter_gets_a_worker_that_joins():
    registry = Registry()
    joining = make_session("a", loaded=(MODEL,))
    asyncio.get_running_loop().call_soon(registry.add, joining, DummyConnection())
    async with asyncio.timeout(5):
        worker = await registry.wait_for_worker(MODEL, "caller", 30)
    assert worker is joining
    assert registry.waiting == 0
    assert len(registry) == 1


async def test_a_wait_times_out_and_leaves_the_queue():
    registry = Registry()
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(TimeoutError):
        await registry.wait_for_worker(MODEL, "caller", 0.05)
    assert loop.time() - start >= 0.05
    assert registry.waiting == 0


async def test_a_cancelled_waiter_is_never_handed_a_slot():
    registry = Registry()
    session = make_session("a", loaded=(MODEL,))
    add(registry, session)
    handle = handle_on(session)
    registry.lease(session, handle)
    waiting = asyncio.create_task(registry.wait_for_worker(MODEL, "gone", 30))
    await asyncio.sleep(0)  # let it queue
    assert registry.waiting == 1
    waiting.cancel()  # its client left
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert registry.waiting == 0
    registry.release(handle.id)
    assert session.reserved == 0
    assert session.free_slots == 1
    assert registry.choose(MODEL) is session


async def test_waiters_of_a_model_that_loses_its_last_worker_look_again_at_once():
    registry = Registry()
    session = make_session("a", loaded=(MODEL,))
    add(registry, session)
    registry.lease(session, handle_on(session))
    waiting = asyncio.create_task(registry.wait_for_worker(MODEL, "caller", 30))
    await asyncio.sleep(0)
    registry.remove(session, "gone")
    async with asyncio.timeout(5):
        assert await waiting is None
    assert registry.waiting == 0


async def test_close_all_removes_and_closes_every_session():
    registry = Registry()
    sessions = [make_session("a"), make_session("b")]
    connections = add(registry, *sessions)
    await registry.close_all(1001, "queen shutting down")
    assert len(registry) == 0
    for session, connection in zip(sessions, connections, strict=True):
        assert session.closed is True
        assert connection.closed == [(1001, "queen shutting down")]


# --- leases by job id --------------------------------------------------------------------------


async def test_leases_are_kept_by_job_id_and_read_per_worker():
    registry = Registry()
    a = make_session("a", loaded=(MODEL,), max_jobs=2)
    b = make_session("b", loaded=(MODEL,))
    add(registry, a, b)
    first, second = handle_on(a, "j1"), handle_on(b, "j2")
    registry.lease(a, first)
    registry.lease(b, second)
    assert (registry.free_slots("a"), registry.free_slots("b"), registry.free_slots("zz")) == (
        1, 0, 0)
    assert dict(registry.leases_of("a")) == {"j1": first}
    assert registry.leases_of("zz") == {}
    assert registry.is_leased("j2")
    assert registry.leased == 2
    with pytest.raises(TypeError):
        a.jobs["x"] = first  # type: ignore[index]  # a worker's view of its leases is read-only
    registry.release("j2")  # by job id alone
    assert b.free_slots == 1
    assert not registry.is_leased("j2")
    assert registry.leased == 1


async def test_a_worker_that_leaves_takes_its_leases_and_a_newer_one_starts_clean():
    registry = Registry()
    older = make_session("k", loaded=(MODEL,))
    add(registry, older)
    handle = handle_on(older, "j1")
    registry.lease(older, handle)
    newer = make_session("k", loaded=(MODEL,))
    registry.add(newer, DummyConnection())
    assert not registry.is_leased("j1")
    assert older.jobs == {}
    assert newer.free_slots == 1
    registry.lease(newer, handle_on(newer, "j2"))
    registry.release("j1")  # the older worker's late release leaves the newer one's lease alone
    assert set(newer.jobs) == {"j2"}
    with pytest.raises(RuntimeError):
        registry.lease(older, handle_on(older, "j3"))  # no longer registered


async def test_apply_status_changes_slots_and_reindexes_models():
    registry = Registry()
    session = make_session("a", cached=(MODEL,))
    add(registry, session)
    registry.apply_status(session, max_jobs=4)
    assert (session.max_jobs, session.free_slots) == (4, 4)
    assert registry.holders(MODEL) == {session}
    registry.apply_status(session, models=[ModelDescriptor(name=OTHER, loaded=True)])
    assert registry.holders(MODEL) == set()
    assert registry.holders(OTHER) == {session}
    assert session.loaded == {OTHER}


def test_worker_facts():
    worker = make_session("w", loaded=(MODEL,), capabilities=("chat", CAPABILITY_FETCH))
    assert (worker.can_fetch, worker.earnings_key, worker.free_slots) == (True, "w", 1)
    legacy = Worker(key="legacy-1", public_id="legacy-1", session_id="1", max_jobs=8,
                    legacy=True)
    assert (legacy.max_jobs, legacy.can_fetch, legacy.earnings_key) == (1, True, None)
    assert "legacy-1" in repr(legacy)
