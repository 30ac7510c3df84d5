"""The engine protocol's core on its own: framing, and the worker's state machine refusing
whatever a hostile child could send (a frame too large, not JSON, malformed, out of turn,
another version) before any of it reaches the job."""

from __future__ import annotations

import orjson
import pytest

from desktop_worker.errors import EngineProtocolError
from desktop_worker.sandbox.ipc import (
    ChildLink,
    EngineLink,
    FrameDecoder,
    FrameTooLarge,
    State,
    frame,
)
from shared_schema.engine_ipc import (
    ENGINE_IPC_VERSION,
    Cancel,
    Chunk,
    Confinement,
    Done,
    Embed,
    Embedded,
    Hello,
    Load,
    Loaded,
    SandboxPolicy,
    Scored,
    ScoreJob,
    Start,
    Stream,
    encode,
)

POLICY = SandboxPolicy(read_paths=["/usr"], scratch="/tmp/x")
HELLO = Hello(version=ENGINE_IPC_VERSION, pid=42, confinement=Confinement(os="linux"))
LOAD = Load(name="smol", model_path="/m.gguf", n_ctx=512, n_gpu_layers=0)


def wire(message) -> bytes:  # type: ignore[no-untyped-def]
    return frame(encode(message))


def ready_link() -> EngineLink:
    link = EngineLink("context")
    link.start(POLICY)
    link.receive(wire(HELLO))
    link.load(LOAD)
    link.receive(wire(Loaded(n_ctx=512)))
    return link


def test_frames_come_out_whole_however_the_bytes_are_cut() -> None:
    decoder = FrameDecoder(1024)
    data = frame(b"one") + frame(b"") + frame(b"three")
    out = []
    for i in range(len(data)):
        out += decoder.feed(data[i:i + 1])
    assert out == [b"one", b"", b"three"]
    assert decoder.buffered == 0


def test_a_length_past_the_limit_is_refused_before_its_body_is_kept() -> None:
    decoder = FrameDecoder(1024)
    with pytest.raises(FrameTooLarge):
        decoder.feed((2**31).to_bytes(4, "big") + b"x" * 10)
    assert decoder.buffered <= 14


def test_the_worker_walks_a_child_through_load_stream_and_cancel() -> None:
    link = EngineLink("context")
    start = link.start(POLICY)
    assert ChildLink().receive(start)[0] == Start(version=ENGINE_IPC_VERSION, role="context",
                                                  policy=POLICY)
    [hello] = link.receive(wire(HELLO))
    assert link.hello == hello
    assert link.state is State.IDLE
    link.load(LOAD)
    link.receive(wire(Loaded(n_ctx=512)))
    assert link.state is State.READY
    job = link.next_job()
    sent = link.stream(Stream(job=job, kind="chat", request={"messages": []}))
    assert isinstance(ChildLink().receive(sent)[0], Stream)
    assert link.cancel(job) == wire(Cancel(job=job))
    assert link.cancel(job) is None  # once per job
    chunk = frame(orjson.dumps({"type": "chunk", "job": job, "data": {"choices": []}}))
    assert link.receive(chunk) == [Chunk(job=job, data={"choices": []})]
    done = Done(job=job, prompt_tokens=3, completion_tokens=1, total_tokens=4)
    assert link.receive(wire(done)) == [done]
    assert link.state is State.READY
    assert link.cancel(job) is None  # nothing in flight


def batched_link(slots: int) -> EngineLink:
    link = EngineLink("context")
    link.start(POLICY)
    link.receive(wire(HELLO))
    link.load(LOAD.model_copy(update={"slots": slots}))
    link.receive(wire(Loaded(n_ctx=512, slots=slots)))
    return link


def test_a_batched_child_answers_its_jobs_interleaved() -> None:
    link = batched_link(2)
    first, second = link.next_job(), link.next_job()
    link.stream(Stream(job=first, kind="chat", request={}))
    link.score(ScoreJob(job=second, kind="chat", request={}, answer="x"))
    replies = [Chunk(job=first, data={"n": 1}), Scored(job=second, data=None),
               Chunk(job=first, data={"n": 2}),
               Done(job=first, prompt_tokens=1, completion_tokens=2, total_tokens=3)]
    assert link.receive(b"".join(wire(reply) for reply in replies)) == replies
    assert link.in_flight == 0


def test_no_more_jobs_than_slots_and_no_reused_numbers() -> None:
    link = batched_link(2)
    jobs = [link.next_job() for _ in range(3)]
    link.stream(Stream(job=jobs[0], kind="chat", request={}))
    with pytest.raises(EngineProtocolError, match="new job"):
        link.stream(Stream(job=jobs[0], kind="chat", request={}))
    with pytest.raises(EngineProtocolError, match="new job"):
        link.stream(Stream(job=99, kind="chat", request={}))  # not handed out
    link.stream(Stream(job=jobs[1], kind="chat", request={}))
    with pytest.raises(EngineProtocolError, match="2 jobs at once"):
        link.stream(Stream(job=jobs[2], kind="chat", request={}))


@pytest.mark.parametrize("reply", [
    Chunk(job=7, data={}),  # a job never asked for
    Scored(job=1, data=None),  # a score's answer to a stream
    Embedded(job=1, vectors=[[1.0]], tokens=1),
])
def test_a_reply_to_another_job_or_of_another_kind_ends_the_child(reply) -> None:  # type: ignore[no-untyped-def]
    link = batched_link(4)
    link.stream(Stream(job=link.next_job(), kind="chat", request={}))
    with pytest.raises(EngineProtocolError):
        link.receive(wire(reply))
    assert link.state is State.CLOSED


@pytest.mark.parametrize("payload", [
    b"not json",
    b'{"type": "chunk", "job": 1}',  # no data
    b'{"type": "chunk", "data": {}}',  # no job
    b'{"type": "done", "job": 1, "prompt_tokens": -1, "completion_tokens": 0, '
    b'"total_tokens": 0}',
    b'{"type": "done", "job": 1, "prompt_tokens": "3", "completion_tokens": 0, '
    b'"total_tokens": 3}',
    b'{"type": "embedded", "job": 1, "vectors": [[1.0]], "tokens": 1}',  # out of turn
    b'{"type": "hello", "version": 2, "pid": 1, "confinement": {"os": "linux"}}',  # again
    b'{"type": "python", "pickle": "cos\\nsystem\\n"}',
    b'{"type": "chunk", "job": 1, "data": {}, "extra": 1}',
    b'{"type": "chunk", "job": "1", "data": {}}',
])
def test_anything_but_the_expected_reply_ends_the_child(payload: bytes) -> None:
    link = ready_link()
    link.stream(Stream(job=link.next_job(), kind="chat", request={}))
    with pytest.raises(EngineProtocolError):
        link.receive(frame(payload))
    assert link.state is State.CLOSED


def test_a_child_of_another_version_is_refused() -> None:
    link = EngineLink("context")
    link.start(POLICY)
    other = HELLO.model_copy(update={"version": ENGINE_IPC_VERSION + 1})
    with pytest.raises(EngineProtocolError, match="reinstall"):
        link.receive(wire(other))


def test_a_reply_before_any_command_is_refused() -> None:
    link = ready_link()
    with pytest.raises(EngineProtocolError, match="no job in flight"):
        link.receive(wire(Done(job=1, prompt_tokens=0, completion_tokens=0, total_tokens=0)))


def test_commands_out_of_turn_are_refused_on_the_workers_side_too() -> None:
    link = EngineLink("context")
    with pytest.raises(EngineProtocolError):
        link.stream(Stream(job=link.next_job(), kind="chat", request={}))  # nothing loaded
    member = EngineLink("member")
    with pytest.raises(EngineProtocolError):
        member.load(LOAD)
    ready = ready_link()
    ready.embed(Embed(job=ready.next_job(), inputs=["a"]))
    with pytest.raises(EngineProtocolError):
        ready.stream(Stream(job=ready.next_job(), kind="chat", request={}))  # one slot


def test_an_oversized_frame_from_a_child_ends_it() -> None:
    link = EngineLink("context", max_frame_bytes=1000)
    link.start(POLICY)
    with pytest.raises(EngineProtocolError, match="over the 1000"):
        link.receive((5000).to_bytes(4, "big"))
