"""Job mailboxes, the worker registry and its leases, and how sessions route frames."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from queen_server.swarm.jobs import JobHandle, WorkerLost
from queen_server.swarm.registry import Registry
from queen_server.swarm.sessions import CAPABILITY_FETCH, LegacySession, WorkerSession
from shared_schema import (
    Chunk,
    Job,
    JobError,
    LegacyRequest,
    ModelDescriptor,
    Ping,
    ProtocolError,
    Result,
    Status,
    Usage,
    decode,
    encode,
)

MODEL = "org/repo:Q4_K_M"
OTHER = "org/other:Q8_0"
FIXTURES = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "original"
USAGE = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)


class DummyTransport:
    def __init__(self) -> None:
        self.sent: list[str] = []
        self.closed: list[tuple[int, str]] = []

    async def send_text(self, data: str) -> None:
        self.sent.append(data)

    async def close(self, code: int, reason: str) -> None:
        self.closed.append((code, reason))


def make_session(
    key: str,
    *,
    loaded: tuple[str, ...] = (),
    cached: tuple[str, ...] = (),
    capabilities: tuple[str, ...] = ("chat",),
    max_jobs: int = 1,
    cls: type[WorkerSession] = WorkerSession,
) -> WorkerSession:
    models = [ModelDescriptor(name=name, loaded=True) for name in loaded]
    models += [ModelDescriptor(name=name) for name in cached]
    kwargs: dict[str, Any] = {
        "key": key,
        "public_id": f"id-{key}",
        "session_id": f"s-{key}",
        "transport": DummyTransport(),
        "models": models,
        "capabilities": capabilities,
    }
    if cls is WorkerSession:
        kwargs["max_jobs"] = max_jobs
    return cls(**kwargs)


def make_legacy(key: str) -> LegacySession:
    return LegacySession(
        key=key, public_id=key, session_id=f"s-{key}", transport=DummyTransport(), max_jobs=1
    )


def handle_on(session: WorkerSession, job_id: str = "job-1") -> JobHandle:
    return JobHandle(job_id, MODEL, session, started_at=0.0)


def deadline(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


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
    for session in (a, b, c):
        assert registry.add(session) is None
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
    for session in (holder, fetcher, legacy, plain):
        registry.add(session)
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
    registry.add(session)
    session.set_models([ModelDescriptor(name=OTHER, loaded=True)])
    registry.models_changed(session)
    assert registry.holders(MODEL) == set()
    assert registry.holders(OTHER) == {session}
    assert registry.model_names() == [OTHER]
    assert session.loaded == {OTHER}


async def test_adding_the_same_key_twice_replaces_the_older_session():
    registry = Registry()
    older = make_session("k", loaded=(MODEL,), max_jobs=2)
    registry.add(older)
    first, second = handle_on(older, "j1"), handle_on(older, "j2")
    registry.lease(older, first)
    registry.lease(older, second)
    first.feed(Result(id="j1", usage=USAGE))  # already finished: gets no WorkerLost
    ended: list[JobHandle] = []
    second.on_end = ended.append

    newer = make_session("k", cached=(OTHER,))
    assert registry.add(newer) is older
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
    registry.add(session)
    handle = handle_on(session)
    registry.lease(session, handle)
    registry.remove(session, "heartbeat missed")
    event = await handle.next(deadline(5))
    assert event == WorkerLost("heartbeat missed")


async def test_lease_and_release_respect_max_jobs():
    registry = Registry()
    session = make_session("a", loaded=(MODEL,), max_jobs=2)
    registry.add(session)
    handles = [handle_on(session, f"j{i}") for i in range(3)]
    assert session.free_slots == 2
    registry.lease(session, handles[0])
    registry.lease(session, handles[1])
    assert session.free_slots == 0
    assert session.jobs == {"j0": handles[0], "j1": handles[1]}
    with pytest.raises(RuntimeError):
        registry.lease(session, handles[2])
    assert "j2" not in session.jobs
    registry.release(handles[0])
    assert session.free_slots == 1
    registry.lease(session, handles[2])
    assert set(session.jobs) == {"j1", "j2"}
    registry.release(handles[0])  # releasing twice is harmless
    assert session.free_slots == 0


async def test_legacy_session_takes_one_job_at_a_time():
    registry = Registry()
    legacy = LegacySession(
        key="l", public_id="l", session_id="s", transport=DummyTransport(), max_jobs=8
    )
    registry.add(legacy)
    assert legacy.max_jobs == 1
    registry.lease(legacy, handle_on(legacy, "j1"))
    with pytest.raises(RuntimeError):
        registry.lease(legacy, handle_on(legacy, "j2"))


async def test_wait_for_change_wakes_on_release():
    registry = Registry()
    session = make_session("a", loaded=(MODEL,))
    registry.add(session)
    handle = handle_on(session)
    registry.lease(session, handle)
    loop = asyncio.get_running_loop()
    seen_waiting: list[int] = []

    def release() -> None:  # runs once the waiter below is parked on its event
        seen_waiting.append(registry.waiting)
        registry.release(handle)

    loop.call_soon(release)
    start = loop.time()
    async with asyncio.timeout(5):
        await registry.wait_for_change(30)
    assert loop.time() - start < 5
    assert seen_waiting == [1]
    assert registry.waiting == 0
    assert session.free_slots == 1


async def test_wait_for_change_wakes_when_a_worker_joins():
    registry = Registry()
    asyncio.get_running_loop().call_soon(registry.add, make_session("a", loaded=(MODEL,)))
    async with asyncio.timeout(5):
        await registry.wait_for_change(30)
    assert registry.waiting == 0
    assert len(registry) == 1


async def test_wait_for_change_returns_after_its_timeout():
    registry = Registry()
    loop = asyncio.get_running_loop()
    start = loop.time()
    await registry.wait_for_change(0.05)
    assert loop.time() - start >= 0.05
    assert registry.waiting == 0


async def test_a_change_with_nobody_waiting_does_not_wake_a_later_waiter():
    registry = Registry()
    session = make_session("a", loaded=(MODEL,))
    registry.add(session)
    handle = handle_on(session)
    registry.lease(session, handle)
    registry.release(handle)  # nobody is waiting yet
    loop = asyncio.get_running_loop()
    start = loop.time()
    await registry.wait_for_change(0.05)
    assert loop.time() - start >= 0.05


async def test_close_all_removes_and_closes_every_session():
    registry = Registry()
    sessions = [make_session("a"), make_session("b")]
    for session in sessions:
        registry.add(session)
    await registry.close_all(1001, "queen shutting down")
    assert len(registry) == 0
    for session in sessions:
        assert session.closed is True
        assert session.transport.closed == [(1001, "queen shutting down")]


# --- WorkerSession frames ----------------------------------------------------------------------


async def test_worker_session_routes_job_frames_and_returns_the_rest():
    session = make_session("w", loaded=(MODEL,), max_jobs=2)
    handle = handle_on(session, "j1")
    session.jobs["j1"] = handle
    chunk = Chunk(id="j1", seq=0, data={"x": 1})
    assert session.on_frame(encode(chunk)) is None
    assert session.on_frame(encode(Result(id="j1", usage=USAGE))) is None
    assert handle.take_ready() == [chunk, Result(id="j1", usage=USAGE)]
    # Frames after the end, or for another worker's job, are dropped.
    assert session.on_frame(encode(Chunk(id="j1", seq=1, data={}))) is None
    assert session.on_frame(encode(Result(id="not-mine", usage=USAGE))) is None
    assert handle.take_ready() == []
    status = Status(active_jobs=1)
    assert session.on_frame(encode(status)) == status
    assert session.on_frame(encode(Ping(ts=1.0))) == Ping(ts=1.0)
    with pytest.raises(ProtocolError):
        session.on_frame("{not json")


async def test_worker_session_sends_job_and_cancel_frames():
    session = make_session("w", loaded=(MODEL,))
    handle = handle_on(session, "j1")
    await session.send_job(handle, "/v1/chat/completions", {"model": MODEL, "stream": True})
    await session.send_cancel("j1", "client_gone")
    sent = [decode(frame) for frame in session.transport.sent]
    assert sent[0] == Job(id="j1", openai_url="/v1/chat/completions",
                          openai_req={"model": MODEL, "stream": True})
    assert sent[1].type == "cancel"
    assert sent[1].id == "j1"


# --- LegacySession frames ----------------------------------------------------------------------


async def test_legacy_session_sends_a_bare_non_streaming_request():
    legacy = make_legacy("l")
    handle = handle_on(legacy)
    request = orjson.loads((FIXTURES / "request.json").read_text())
    await legacy.send_job(handle, request["openai_url"], {**request["openai_req"], "stream": True})
    sent = orjson.loads(legacy.transport.sent[0])
    assert "type" not in sent
    assert LegacyRequest.model_validate(sent).openai_url == request["openai_url"]
    assert sent["openai_req"] == {**request["openai_req"], "stream": False}
    await legacy.send_cancel(handle.id, "timeout")  # cannot be cancelled: nothing is sent
    assert len(legacy.transport.sent) == 1


async def test_legacy_answer_becomes_the_result_of_the_job_in_flight():
    legacy = make_legacy("l")
    handle = handle_on(legacy, "job-42")
    legacy.jobs[handle.id] = handle
    answer_text = (FIXTURES / "response.json").read_text()
    assert legacy.on_frame(answer_text) is None
    assert handle.finished is True
    [event] = handle.take_ready()
    assert isinstance(event, Result)
    assert event.id == "job-42"
    assert event.data == orjson.loads(answer_text)
    assert event.usage == Usage(prompt_tokens=56, completion_tokens=31, total_tokens=87)


async def test_legacy_answer_without_usage_gets_zero_usage():
    legacy = make_legacy("l")
    handle = handle_on(legacy)
    legacy.jobs[handle.id] = handle
    legacy.on_frame('{"object": "list", "data": [{"index": 0, "embedding": [0.5]}]}')
    [event] = handle.take_ready()
    assert isinstance(event, Result)
    assert event.usage == Usage(prompt_tokens=0, total_tokens=0)


@pytest.mark.parametrize(
    ("body", "code", "message"),
    [
        ({"error": {"message": "model not found", "code": "model_missing"}},
         "model_missing", "model not found"),
        ({"error": {"message": "out of memory"}}, "worker_error", "out of memory"),
        ({"error": "it broke"}, "worker_error", "it broke"),
    ],
)
async def test_legacy_error_becomes_a_retryable_job_error(body, code, message):
    legacy = make_legacy("l")
    handle = handle_on(legacy, "job-7")
    legacy.jobs[handle.id] = handle
    assert legacy.on_frame(orjson.dumps(body).decode()) is None
    assert handle.finished is True
    [event] = handle.take_ready()
    assert isinstance(event, JobError)
    assert event.id == "job-7"
    assert event.retryable is True
    assert event.code == code
    assert event.message == message


async def test_legacy_frame_with_no_job_in_flight_is_dropped():
    legacy = make_legacy("l")
    answer_text = (FIXTURES / "response.json").read_text()
    assert legacy.on_frame(answer_text) is None  # no job at all: no error either
    handle = handle_on(legacy)
    legacy.jobs[handle.id] = handle
    handle.feed(JobError(id=handle.id, code="timeout", message="too slow"))
    handle.take_ready()
    assert legacy.on_frame(answer_text) is None  # the job already ended
    assert handle.take_ready() == []


async def test_legacy_frame_that_is_not_an_answer_is_a_protocol_error():
    legacy = make_legacy("l")
    handle = handle_on(legacy)
    legacy.jobs[handle.id] = handle
    with pytest.raises(ProtocolError) as info:
        legacy.on_frame('{"hello": "world"}')
    assert info.value.code == "invalid_message"
    with pytest.raises(ProtocolError) as broken:
        legacy.on_frame("{broken")
    assert broken.value.code == "invalid_json"
    assert handle.finished is False
